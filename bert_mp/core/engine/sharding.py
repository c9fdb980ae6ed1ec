"""FSDP2 on CPU: bert_mp's thin wrap of torch's ``fully_shard`` and its sharded checkpoint.

Accelerate gives FSDP only on GPU-like devices; on a CPU launch it would wrap the model in DDP. So
where the launch asks for FSDP and there is no CUDA (:mod:`bert_mp.core.engine.strategy`), bert_mp shards the
model itself, over the gloo process group Accelerate set up:

- every module named by ``fsdp_transformer_layer_cls_to_wrap`` (``BertLayer``) is one FSDP unit, the
  root unit holds the rest - the embeddings, the pooler and the heads, whose MLM decoder shares its
  weight with the word embeddings (a tied weight must live in one unit);
- gradients are reduce-scattered as a SUM followed by an explicit division by the world size
  (``set_force_sum_reduction_for_comms``), never through the backend's AVG: an AVG that gloo does
  not honour would silently multiply every gradient by the world size (pytorch issue #162338), which
  Adam's normalisation hides from the loss but not from the gradient norm the tests compare;
- parameters, gradients and optimizer state stay fp32; bf16 comes from the loop's autocast.

The model is registered with Accelerate without a DDP wrapper (``prepare_model(evaluation_mode=True)``).

A checkpoint's model and optimizer are written by ``torch.distributed.checkpoint`` into
``sharded/``, every rank its own shard, in safetensors files (``HuggingFaceStorageWriter``: the
offsets of each shard are in the file's header, so nothing is pickled and a checkpoint loads on
another number of processes); the optimizer's hyperparameters (``param_groups``) go into
``optimizer_groups.safetensors`` as every bert_mp state file. The checkpoint's manifest covers the
shards like any other file. The export gathers the full state dict to the main process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHARDED_DIR = "sharded"
"""The checkpoint subfolder holding the model and optimizer shards (``torch.distributed.checkpoint``)."""
GROUPS_FILE = "optimizer_groups.safetensors"
MODEL_PREFIX, OPTIM_PREFIX = "model.", "optim."


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded with ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, layer_classes: tuple[str, ...], reshard_after_forward: bool) -> Any:
    """``model`` sharded in place over the default process group: each ``layer_classes`` module a
    unit, the root unit the rest (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from bert_mp.errors import ConfigError

    if not dist.is_initialized():
        raise ConfigError(
            "FSDP needs a launch that starts its processes: `bert-mp launch --config_file "
            "configs/accelerate/fsdp.yaml --num_processes N train ...`"
        )
    units = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not units:
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap: {', '.join(layer_classes)} in the accelerate config names "
            "no module of the model; set it to BertLayer"
        )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for m in model.modules():  # per unit: the setting is not recursive
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def prepare(accelerator: Any, model: Any, optimizer: Any) -> tuple[Any, Any]:
    """Register a sharded model with Accelerate as it is (no DDP wrapper, no device move; the mixed
    precision Accelerate adds to a forward still applies) and prepare the optimizer."""
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    return model, accelerator.prepare_optimizer(optimizer)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this process; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: Any) -> Any:
    """A DTensor gathered whole on every process (collective); anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------------------------------------
# the sharded checkpoint
# --------------------------------------------------------------------------------------------------
def _unique(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state without aliases (a tied weight once) and ``{alias: kept name}``."""
    kept: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        shard = local(t)
        key = (shard.data_ptr(), tuple(shard.shape), shard.dtype)
        if shard.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = t
    return kept, aliases


def _flat(model_state: dict, optim_state: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One flat dict of tensors: ``model.<name>`` and ``optim.<param>.<state>``; and the model's aliases."""
    kept, aliases = _unique(model_state)
    flat = {MODEL_PREFIX + k: v for k, v in kept.items()}
    for param, entries in optim_state.get("state", {}).items():
        for k, v in entries.items():
            if not torch.is_tensor(v):
                raise TypeError(f"optimizer state {param}.{k} is a {type(v).__name__}, not a tensor")
            flat[f"{OPTIM_PREFIX}{param}.{k}"] = v
    return flat, aliases


def _states(model: Any, optimizer: Any) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, getattr(optimizer, "optimizer", optimizer))


def save_sharded(model: Any, optimizer: Any, folder: Path) -> list[dict]:
    """Write this rank's shard of the model and optimizer into ``folder/sharded`` (collective); returns
    the optimizer's ``param_groups`` (its hyperparameters, the same on every rank) for the caller to
    write beside them (``optimizer_groups.safetensors``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model_state, optim_state = _states(model, optimizer)
    flat, _ = _flat(model_state, optim_state)
    writer = HuggingFaceStorageWriter(str(Path(folder) / SHARDED_DIR), save_distributed=True)
    dcp.save(flat, storage_writer=writer)
    return optim_state["param_groups"]


def load_sharded(model: Any, optimizer: Any, folder: Path, param_groups: list[dict]) -> None:
    """Restore what :func:`save_sharded` wrote (every rank reading the pieces of its own shard), with
    the optimizer's saved ``param_groups``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optim_state = _states(model, optimizer)  # the optimizer's state is created if empty
    flat, aliases = _flat(model_state, optim_state)
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(Path(folder) / SHARDED_DIR)))
    loaded_model = {k.removeprefix(MODEL_PREFIX): v for k, v in flat.items() if k.startswith(MODEL_PREFIX)}
    for alias, name in aliases.items():
        loaded_model[alias] = loaded_model[name]
    loaded_optim = {
        "state": {
            param: {k: flat[f"{OPTIM_PREFIX}{param}.{k}"] for k in entries}
            for param, entries in optim_state["state"].items()
        },
        "param_groups": param_groups,
    }
    set_state_dict(
        model,
        getattr(optimizer, "optimizer", optimizer),
        model_state_dict=loaded_model,
        optim_state_dict=loaded_optim,
    )


def full_model_state(model: Any) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the main process, on the CPU (empty elsewhere; collective); a
    tied weight once, under its first name, as an unsharded model's export has it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return without_aliases(full, model)


def without_aliases(state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """``state`` (a gathered copy of ``module``'s state dict) without the names that share a tensor
    in ``module`` itself: a tied weight once, under its first name, as ``save_pretrained`` of an
    unsharded model writes it."""
    _, aliases = _unique(module.state_dict())
    return {k: v for k, v in state.items() if k not in aliases}


def read_model(folder: Path, model: torch.nn.Module, prefix: str = "") -> None:
    """Load the model part of a sharded checkpoint into an unsharded ``model`` in this process alone
    (``bert-mp export``); ``prefix`` + the model's own names are the names the run's model had."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    kept, _ = _unique(model.state_dict())
    template = {MODEL_PREFIX + prefix + k: v for k, v in kept.items()}
    dcp.load(template, storage_reader=HuggingFaceStorageReader(str(Path(folder) / SHARDED_DIR)), no_dist=True)
