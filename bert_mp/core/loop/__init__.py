"""The training loop both products share: :mod:`.skeleton` (the loop, written once), :mod:`.setup` (its
set-up sequence, its order written once), :mod:`.state`
(loop state, signals, exit codes), :mod:`.update` (the optimizer step after a backward),
:mod:`.callbacks` (the protocol and the monitors every loop can use), :mod:`.checkpoint_saver` (when
to save), :mod:`.numerics_guard` (non-finite losses, fp16 overflow streaks), :mod:`.run_log` (config,
metrics and summary files) and :mod:`.epochs` (the data order of an epoch). The top room of the core."""
