"""The process and its machine: :mod:`.accelerator` (the Accelerator of a precision plan),
:mod:`.strategy` (the distributed strategy in force, and refusals of what the launch cannot give),
:mod:`.sharding` (FSDP2 ``fully_shard`` on CPU launches), :mod:`.distributed` (DeepSpeed / FSDP settings
and engine helpers), :mod:`.launch`, :mod:`.launch_report`, :mod:`.launcher` and :mod:`.machines`
(``bert-mp launch``: its one-line reports and log, a rank's watch on it, several machines),
:mod:`.conditions` (threads, load and the start-up line), :mod:`.console` and :mod:`.noise` (one-line
errors, quiet libraries), :mod:`.hold` (hold points for tests), :mod:`.hub` (the Hub reference),
:mod:`.device_feed` (DataLoader settings per device) and :mod:`.run_dir` (one writer per output
folder, and what it may hold). Imports storage, config and numerics only."""
