"""The parallel engine a run trains on: :mod:`.accelerator` (the Accelerator of a precision plan),
:mod:`.strategy` (the distributed strategy in force, and refusals of what the launch cannot give),
:mod:`.sharding` (FSDP2 ``fully_shard`` on CPU launches), :mod:`.distributed` (DeepSpeed / FSDP
settings) and :mod:`.gradients` (backward, the accumulation boundary, the gradient norm and clipping:
the one adapter both loops call). Imports storage, config, numerics and process only."""
