"""Files on disk: :mod:`.files` (atomic writes, JSON lines, local-path checks), :mod:`.disk` (a full
disk or a failing write as one actionable error), :mod:`.checksums` (content checksums of a folder's
files and their manifest) and :mod:`.folder_lock` (one writer per folder: an OS lock with its holder).
The bottom room: imports nothing else from ``bert_mp.core``."""
