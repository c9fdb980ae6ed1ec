"""Checkpoints: :mod:`.store` (atomic save, verification, rotation and restore of a training state),
:mod:`.state_codec` (optimizer, scheduler, RNG and loop state as tensors and JSON, no pickle; sharded
states through torch.distributed.checkpoint) and :mod:`.hf_folder` (the Hugging Face folder writer and
its verification). Imports storage, config, numerics and run only."""
