"""The distributed strategy: what the launch asks for, whether this machine can give it, and what runs.

``accelerate launch --config_file X.yaml`` tells its processes what to run through the environment
(``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED``, ...). Accelerate honours FSDP only
on GPU-like devices: with ``cpu=True`` it builds a MULTI_CPU state and wraps the model in DDP without
a word, and it refuses DeepSpeed outright. bert_mp reads the request itself (:func:`launch_request`)
and, without CUDA,

- **FSDP** shards with its own thin wrap of torch's ``fully_shard`` (:mod:`bert_mp.core.engine.sharding`):
  FSDP2 over gloo, every ``BertLayer`` a unit, the embeddings and heads (tied) in the root unit;
- **DeepSpeed** runs through Accelerate with ``cpu=False`` and the gloo backend (DeepSpeed's CPU
  accelerator), so ZeRO-1/2 shard as they would on GPUs (:func:`state_options`);

and stops before any work, with one line naming the key to change, where it cannot give what was
asked (:func:`check_request`). What runs is a :class:`Strategy`: said in the start-up line, recorded in
``summary.json`` (``strategy``) and shown by the sweep report. ``<section>.strategy`` (default
``auto``) lets a recipe insist on one.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bert_mp.errors import ConfigError

CPU_FSDP_PRECISIONS = ("fp32", "tf32", "bf16")
"""Precisions bert_mp's CPU FSDP wrap runs: fp32 sharded weights, bf16 through autocast. fp16's
GradScaler checks each rank's shard alone (ranks could disagree on skipping a step); bf16_pure and
fp8 replace the weights or their modules, which the wrap does not cover."""
CPU_FSDP_OPTIMIZERS = ("adamw", "stable_adamw", "lion")
"""Optimizers whose update is elementwise, so a shard of each state tensor updates on its own
(LAMB's trust ratio and Sophia's Hessian estimate need whole tensors)."""


def _flag(environ: Mapping[str, str], key: str, default: bool = False) -> bool:
    return environ.get(key, str(default)).strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Request:
    """What the launch asks for (from ``accelerate launch``'s environment for its processes)."""

    engine: str = "ddp"
    """ddp (a plain multi-process or single launch) | fsdp | deepspeed."""
    fsdp_version: int = 2
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    state_dict_type: str = "SHARDED_STATE_DICT"
    layer_classes: tuple[str, ...] = ("BertLayer",)
    """Module classes that become their own FSDP unit (``fsdp_transformer_layer_cls_to_wrap``)."""
    zero_stage: int | None = None


def launch_request(environ: Mapping[str, str] | None = None) -> Request:
    """The strategy the launcher asked this process for."""
    env = os.environ if environ is None else environ
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        return Request("deepspeed", zero_stage=int(stage) if stage.isdigit() else None)
    if _flag(env, "ACCELERATE_USE_FSDP"):
        version = env.get("FSDP_VERSION", "1")
        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower()
        classes = tuple(
            c.strip() for c in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip()
        )
        return Request(
            "fsdp",
            fsdp_version=int(version) if version.isdigit() else 1,
            reshard_after_forward=reshard not in ("false", "0", "no", "shard_grad_op", "no_shard"),
            offload_params=_flag(env, "FSDP_OFFLOAD_PARAMS"),
            activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING"),
            state_dict_type=env.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
            layer_classes=classes or ("BertLayer",),
        )
    return Request()


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def state_options(request: Request, cuda: bool) -> dict[str, Any]:
    """``PartialState`` / ``Accelerator`` arguments for this launch: ``cpu`` and, for DeepSpeed on a
    machine without CUDA, the gloo backend (Accelerate's ``cpu=True`` would drop DeepSpeed)."""
    if cuda:
        return {"cpu": False}
    # DeepSpeed's CPU accelerator named, not guessed (its guess warns on stdout wherever it is imported)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if request.engine == "deepspeed" and deepspeed_installed():
        _skip_inference_all_reduce_build()
        return {"cpu": False, "backend": "gloo"}
    return {"cpu": True}


def _skip_inference_all_reduce_build() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce when its process group starts (g++
    on every fresh machine: about 60 CPU seconds on a 2-vCPU EPYC, then cached in
    ~/.cache/torch_extensions). Only tensor-parallel inference calls it (``inference_all_reduce``);
    training's collectives go through gloo, so bert_mp skips the build."""
    try:  # the submodule by its full name (the package's own ``torch`` attribute is torch itself)
        ds_comm = importlib.import_module("deepspeed.comm.torch")
    except Exception:  # noqa: BLE001 - another DeepSpeed layout: it builds as it always did
        return
    if callable(getattr(ds_comm, "build_shm_op", None)):
        ds_comm.build_shm_op = lambda: None


# --------------------------------------------------------------------------------------------------
# the strategy in force
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    """The distributed strategy a run is under: summary.json's ``strategy`` block."""

    name: str
    """single | ddp | fsdp | deepspeed."""
    processes: int
    machines: int
    backend: str | None
    """gloo | nccl | None (one process)."""
    engine: str
    """Who applies it: ``accelerate`` or ``bert_mp fully_shard`` (FSDP2 on CPU)."""
    sharded: tuple[str, ...] = ()
    """What is split over the processes: of ``parameters``, ``gradients``, ``optimizer state``."""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def parameters_sharded(self) -> bool:
        return "parameters" in self.sharded

    def label(self) -> str:
        """The start-up line's phrase: ``FSDP2 (parameters, gradients and optimizer state sharded;
        bert_mp fully_shard, gloo)``, ``DDP (nothing sharded; gloo)``, ``single process``."""
        if self.name == "single":
            return "single process"
        title = {"ddp": "DDP", "fsdp": f"FSDP{self.details.get('fsdp_version', 2)}"}.get(self.name)
        if self.name == "deepspeed":
            title = f"DeepSpeed ZeRO-{self.details.get('zero_stage', '?')}"
        what = _join(self.sharded) + " sharded" if self.sharded else "nothing sharded"
        if self.sharded and not self.parameters_sharded:
            what += ", parameters whole"
        how = [self.engine] if self.engine != "accelerate" else []
        how += [self.backend] if self.backend else []
        if self.machines > 1:
            how.append(f"{self.machines} machines")
        return f"{title} ({what}; {', '.join(how)})" if how else f"{title} ({what})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sharded"] = list(self.sharded)
        d["parameters_sharded"] = self.parameters_sharded
        d["label"] = self.label()
        return d


def _join(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


ZERO_SHARDS = {
    0: (),
    1: ("optimizer state",),
    2: ("gradients", "optimizer state"),
    3: ("parameters", "gradients", "optimizer state"),
}


def machine_count() -> int:
    """Machines of this launch (torch elastic's node count), 1 without a launcher."""
    value = os.environ.get("GROUP_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def strategy_in_force(state: Any, request: Request, cuda: bool) -> Strategy:
    """What runs for ``request`` given the Accelerate ``state`` (an ``Accelerator`` or ``PartialState``)."""
    world = int(state.num_processes)
    kind = str(state.distributed_type).upper()
    backend = getattr(getattr(state, "state", state), "backend", None) if world > 1 else None
    machines = machine_count()
    common = {"processes": world, "machines": machines, "backend": backend}
    if kind.endswith("DEEPSPEED"):
        stage = request.zero_stage if request.zero_stage is not None else _plugin_stage(state)
        shards = ZERO_SHARDS.get(stage, ())
        return Strategy(
            "deepspeed", engine="accelerate", sharded=shards, details={"zero_stage": stage}, **common
        )
    if request.engine == "fsdp":
        everything = ("parameters", "gradients", "optimizer state")
        details = {
            "fsdp_version": request.fsdp_version,
            "reshard_after_forward": request.reshard_after_forward,
            "units": [*request.layer_classes, "root (embeddings, pooler, heads)"],
            "checkpoint": "sharded: torch.distributed.checkpoint, safetensors shards"
            if not cuda
            else request.state_dict_type,
        }
        return Strategy(
            "fsdp",
            engine="accelerate" if cuda else BERT_MP_FSDP,
            sharded=everything if world > 1 else (),
            details=details,
            **common,
        )
    if world > 1:
        return Strategy("ddp", engine="accelerate", **common)
    return Strategy("single", engine="accelerate", **common)


def _plugin_stage(state: Any) -> int | None:
    plugin = getattr(state, "deepspeed_plugin", None)
    stage = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}).get("stage")
    return int(stage) if isinstance(stage, int) else None


# --------------------------------------------------------------------------------------------------
# what a launch cannot give: one line, before any work
# --------------------------------------------------------------------------------------------------
_HOW = {
    "fsdp": "launch with `bert-mp launch --config_file configs/accelerate/fsdp.yaml --num_processes N {cmd} ...`",
    "deepspeed": "launch with `bert-mp launch --config_file configs/accelerate/deepspeed_zero2.yaml "
    "--num_processes N {cmd} ...`",
    "ddp": "launch with `bert-mp launch --num_processes N {cmd} ...` (N of 2 or more)",
    "single": "run `bert-mp {cmd} ...` without a launcher",
}


def check_request(request: Request, section: Any, strategy: Strategy, cuda: bool, command: str) -> None:
    """Stop (:class:`ConfigError`, one line naming the key) where the launch cannot give what was asked:
    ``<section>.strategy`` differs from the strategy in force, DeepSpeed is not installed, or the accelerate
    config asks for FSDP settings or a run that bert_mp's CPU wrap does not give."""
    key = f"{section.SECTION}."
    want = getattr(section, "strategy", "auto")
    if want != "auto" and want != strategy.name:
        raise ConfigError(
            f"{key}strategy={want}: this launch gives {strategy.label()}"
            + (f" over {strategy.processes} processes" if strategy.processes > 1 else "")
            + f"; {_HOW[want].format(cmd=command)}, or set {key}strategy=auto"
        )
    if request.engine == "deepspeed" and not deepspeed_installed():
        raise ConfigError(
            "the accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED) but deepspeed is not "
            "installed: `pip install deepspeed`, or launch with configs/accelerate/cpu_multiprocess.yaml (DDP)"
        )
    if request.engine == "fsdp" and not cuda:
        _check_cpu_fsdp(request, section, command)


def _check_cpu_fsdp(request: Request, section: Any, command: str) -> None:
    """What bert_mp's CPU FSDP wrap (FSDP2, sharded checkpoints) does not give, named by its key."""
    cfg_key = "in the accelerate config (--config_file)"
    refusals = [
        (
            request.fsdp_version != 2,
            f"fsdp_version: {request.fsdp_version} {cfg_key}: on CPU bert_mp shards with FSDP2 "
            "(torch's fully_shard) only; set fsdp_version: 2",
        ),
        (
            request.offload_params,
            f"fsdp_offload_params: true {cfg_key}: on CPU the parameters are in CPU memory already; "
            "set fsdp_offload_params: false",
        ),
        (
            request.activation_checkpointing,
            f"fsdp_activation_checkpointing: true {cfg_key}: not supported by bert_mp's CPU FSDP wrap; "
            "set it to false",
        ),
        (
            request.state_dict_type.upper() != "SHARDED_STATE_DICT",
            f"fsdp_state_dict_type: {request.state_dict_type} {cfg_key}: on CPU checkpoints are sharded "
            "(torch.distributed.checkpoint); set fsdp_state_dict_type: SHARDED_STATE_DICT",
        ),
        (
            command != "train",
            f"FSDP on CPU (the accelerate config's distributed_type: FSDP) runs `bert-mp train` only; "
            f"launch `bert-mp {command}` with configs/accelerate/cpu_multiprocess.yaml (DDP)",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)
    key = section.SECTION
    if section.precision not in CPU_FSDP_PRECISIONS:
        raise ConfigError(
            f"{key}.precision={section.precision} is not supported under FSDP on CPU (bert_mp's fully_shard "
            f"wrap); use one of {', '.join(CPU_FSDP_PRECISIONS)}, or DDP (configs/accelerate/cpu_multiprocess.yaml)"
        )
    if section.optimizer not in CPU_FSDP_OPTIMIZERS:
        raise ConfigError(
            f"{key}.optimizer={section.optimizer} is not supported under FSDP on CPU (its update needs whole "
            f"tensors, each rank holds a shard); use one of {', '.join(CPU_FSDP_OPTIMIZERS)}, or DDP"
        )
    if getattr(section, "compile", "none") != "none":
        raise ConfigError(
            f"{key}.compile={section.compile} is not supported under FSDP on CPU; set {key}.compile=none"
        )


def resolve_strategy(state: Any, section: Any, command: str) -> Strategy:
    """The strategy in force for this process's launch, checked against what was asked (one line and
    exit 2 where the launch cannot give it)."""
    import torch

    cuda = torch.cuda.is_available()
    request = launch_request()
    strategy = strategy_in_force(state, request, cuda)
    check_request(request, section, strategy, cuda, command)
    return strategy


BERT_MP_FSDP = "bert_mp fully_shard"
"""The engine name of bert_mp's own FSDP2 wrap (CPU launches)."""


def shard(strategy: Strategy, model: Any) -> Any:
    """``model`` sharded by bert_mp's FSDP2 wrap where the strategy says so (FSDP on a CPU launch), as it
    is otherwise. Before the optimizer is built: it must see the sharded parameters."""
    if strategy.engine != BERT_MP_FSDP:
        return model
    from bert_mp.core.engine.sharding import shard_model

    request = launch_request()
    return shard_model(model, request.layer_classes, request.reshard_after_forward)


def prepare_parts(accelerator: Any, model: Any, optimizer: Any) -> tuple[Any, Any]:
    """``accelerator.prepare(model, optimizer)``; a model bert_mp sharded is registered as it is."""
    from bert_mp.core.engine import sharding

    if sharding.is_sharded(model):
        return sharding.prepare(accelerator, model, optimizer)
    return accelerator.prepare(model, optimizer)
