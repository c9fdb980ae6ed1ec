"""Files on disk: :mod:`.files` (atomic writes, JSON lines, local-path checks), :mod:`.disk` (a full
disk or a failing write as one actionable error) and :mod:`.checksums` (content checksums of a folder's
files and their manifest). The bottom room: imports nothing else from ``bert_mp.core``."""
