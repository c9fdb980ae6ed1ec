"""The process a command runs in: :mod:`.console` (``bert-mp <command>: ...`` lines, the error line),
:mod:`.noise` (libraries' bars and reports off), :mod:`.hold` (hold points for tests),
:mod:`.conditions` (threads, load, the start-up line), the rank's side of a launch (:mod:`.launcher`:
the watch on ``bert-mp launch`` and the relay of a stop; :mod:`.notes`: the files between ranks and
their launcher; :mod:`.spawn`: the ``accelerate launch`` command line) and :mod:`.run_dir` (one
writer per run folder, and what a resume may change). Imports storage, config and numerics only."""
