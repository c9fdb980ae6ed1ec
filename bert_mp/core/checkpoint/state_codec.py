"""The training state of a checkpoint, written and read without pickle.

``accelerator.save_state`` pickles the optimizer, the scheduler, registered objects, the GradScaler
and the RNG states, and ``load_state`` unpickles some of them with ``weights_only=False``: a crafted
file in a run folder would run code on resume. Here every object is one safetensors file: its tensors,
plus its structure as JSON in the file's metadata (dicts, lists, tuples, numbers, strings, None, and
references to the tensors). Reading builds nothing else, so a checkpoint folder can never execute
code. Files are hashed while they are written (:class:`bert_mp.core.storage.checksums.HashingWriter`).

Layout (``i`` counts objects of a kind, ``r`` the process): ``model.safetensors`` (the model's
state dict; a tied weight stored once, as Accelerate does), ``optimizer.safetensors``,
``scheduler_i.safetensors`` (schedulers passed to ``prepare``), ``custom_state_i.safetensors``
(objects given to ``register_for_checkpointing``), ``scaler.safetensors`` (GradScaler) and
``rng_state_r.safetensors`` (Python, NumPy, torch and CUDA generators of process ``r``).

Under DeepSpeed and FSDP the model and optimizer shards are the engine's own files, saved and loaded
by the engine through Accelerate's helpers (docs/reliability.md says what that trusts); the rest is
written here as above. Under bert_mp's own FSDP2 wrap (CPU launches) they are safetensors shards
written by ``torch.distributed.checkpoint`` (:mod:`bert_mp.core.engine.sharding`), pickle-free as well. Checkpoints from before this layout (``optimizer.bin``, ``*.pkl``,
``scaler.pt``) are read with ``torch.load(weights_only=True)`` and only the NumPy types an RNG state
needs allowed (:func:`read_state` with ``legacy=True``).
"""

from __future__ import annotations

import json
import random
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert_mp.core.storage.checksums import HashingWriter
from bert_mp.errors import BertMPWarning

FORMAT = "bert_mp.state/1"


class StateFileError(ValueError):
    """A checkpoint file that does not hold what it should (malformed, or not a plain state)."""


# --------------------------------------------------------------------------------------------------
# safetensors, streamed
# --------------------------------------------------------------------------------------------------
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def _nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this process's shard
    return t.numel() * t.element_size()


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Write a safetensors file one tensor at a time (no serialized copy of the whole state in memory),
    hashing as it goes; returns the file's manifest entry."""
    if sys.byteorder != "little":  # safetensors is little-endian; so is every platform torch ships for
        raise RuntimeError("checkpoints are written on little-endian machines only")
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot checkpoint tensor {name} of dtype {t.dtype}")
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + _nbytes(t)],
        }
        offset += _nbytes(t)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with HashingWriter(path) as w:
        w.write(struct.pack("<Q", len(head)))
        w.write(head)
        for t in tensors.values():
            cpu = t.detach().to("cpu").contiguous()
            if cpu.numel():
                w.write(cpu.reshape(-1).view(torch.uint8).numpy())
        return w.close()


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file; :class:`StateFileError` when it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 (safe_open is not iterable)
    except Exception as e:  # safetensors raises its own error type for every malformation
        raise StateFileError(
            f"{Path(path).name} is not a readable safetensors file ({_first_line(e)})"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


# --------------------------------------------------------------------------------------------------
# a state object as JSON structure + tensors
# --------------------------------------------------------------------------------------------------
def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """JSON-safe structure of ``obj``; tensors go to ``tensors`` and are referenced by name."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj
        return {"__tensor__": name}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        return {
            "__items__": [
                [_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()
            ]
        }
    raise TypeError(
        f"cannot checkpoint a {type(obj).__name__} at {where}: state must be tensors and plain values"
    )


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_encode`; builds only plain containers, numbers, strings and tensors."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        raise StateFileError(f"unexpected {type(node).__name__} in a state structure")
    if len(node) == 1 and "__tensor__" in node:
        if node["__tensor__"] not in tensors:
            raise StateFileError(f"a state refers to a missing tensor {node['__tensor__']!r}")
        return tensors[node["__tensor__"]]
    if len(node) == 1 and isinstance(node.get("__tuple__"), list):
        return tuple(_decode(v, tensors) for v in node["__tuple__"])
    if len(node) == 1 and isinstance(node.get("__items__"), list):
        pairs = node["__items__"]
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise StateFileError("malformed item list in a state structure")
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in pairs}
    if any(k.startswith("__") for k in node):
        raise StateFileError(f"unexpected keys {sorted(node)[:3]} in a state structure")
    return {k: _decode(v, tensors) for k, v in node.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor)):
        raise StateFileError("a state structure has an unhashable key")
    return key


def save_tree(path: str | Path, obj: Any) -> dict:
    """One state object (a ``state_dict()``) as a safetensors file; returns its manifest entry."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(obj, tensors, Path(path).stem)
    return write_safetensors(path, tensors, {"format": FORMAT, "structure": json.dumps(structure)})


def load_tree(path: str | Path) -> Any:
    """The object :func:`save_tree` wrote (tensors on the CPU)."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != FORMAT or "structure" not in meta:
        raise StateFileError(f"{Path(path).name} is not a bert_mp state file")
    try:
        structure = json.loads(meta["structure"])
    except ValueError as e:
        raise StateFileError(f"{Path(path).name}: unreadable state structure ({e})") from None
    return _decode(structure, tensors)


# --------------------------------------------------------------------------------------------------
# the model: a tied weight stored once
# --------------------------------------------------------------------------------------------------
def _alias_key(t: torch.Tensor) -> tuple:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this process's shard
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def save_model(module: torch.nn.Module, path: str | Path) -> dict:
    """The module's state dict; of names sharing one tensor (tied weights) the first is kept."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in module.state_dict().items():
        key = _alias_key(t)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        kept[name] = t
    return write_safetensors(path, kept, {"format": "pt"})


def load_model(module: torch.nn.Module, path: str | Path) -> None:
    """Load ``path`` into ``module`` strictly; a tied name missing from the file takes its partner's tensor."""
    tensors, _ = read_safetensors(path)
    own = module.state_dict()
    groups: dict[tuple, list[str]] = {}
    for name, t in own.items():
        groups.setdefault(_alias_key(t), []).append(name)
    for name in [n for n in own if n not in tensors]:
        partner = next((n for n in groups[_alias_key(own[name])] if n in tensors), None)
        if partner is not None:
            tensors[name] = tensors[partner]
    missing = [n for n in own if n not in tensors]
    unexpected = [n for n in tensors if n not in own]
    if missing or unexpected:
        raise StateFileError(
            f"{Path(path).name} does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as e:  # a shape that does not fit
        raise StateFileError(f"{Path(path).name} does not fit the model ({_first_line(e)})") from None


# --------------------------------------------------------------------------------------------------
# random number generators
# --------------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every generator a training process draws from (Python, NumPy, torch CPU and CUDA)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (also the dict of a legacy ``random_states_N.pkl``)."""
    if "random_state" in state:  # Accelerate's pickle layout
        state = {
            "python": state["random_state"],
            "numpy": state["numpy_random_seed"],
            "torch": state["torch_manual_seed"],
            **({"cuda": state["torch_cuda_manual_seed"]} if "torch_cuda_manual_seed" in state else {}),
        }
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


# --------------------------------------------------------------------------------------------------
# the whole training state of an accelerator
# --------------------------------------------------------------------------------------------------
def _indexed(stem: str, i: int, ext: str = "safetensors") -> str:
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.safetensors"


def engine(accelerator: Any) -> str | None:
    """``deepspeed`` / ``fsdp`` when a sharded engine owns the model and optimizer, ``fully_shard`` for
    bert_mp's own FSDP2 wrap (CPU launches), else None."""
    from bert_mp.core.engine.sharding import is_sharded

    kind = str(getattr(accelerator, "distributed_type", "")).upper()
    if kind.endswith("DEEPSPEED"):
        return "deepspeed"
    if kind.endswith("FSDP"):
        return "fsdp"
    if any(is_sharded(m) for m in getattr(accelerator, "_models", ())):
        return "fully_shard"
    return None


def _schedulers(accelerator: Any) -> list[Any]:
    """Schedulers passed to ``prepare`` (DeepSpeed's own wrapper is saved with its engine)."""
    return [s for s in accelerator._schedulers if type(s).__name__ != "DeepSpeedSchedulerWrapper"]


def write_state(accelerator: Any, folder: Path) -> dict[str, dict]:
    """Write this process's share of the training state into ``folder``; returns the entries of the
    files it hashed while writing (collective under DeepSpeed/FSDP: every rank calls it)."""
    folder, entries = Path(folder), {}
    eng = engine(accelerator)
    if eng == "fully_shard":
        from bert_mp.core.engine.sharding import GROUPS_FILE, save_sharded

        groups = save_sharded(accelerator._models[0], accelerator._optimizers[0], folder)
        if accelerator.is_main_process:
            entries[GROUPS_FILE] = save_tree(folder / GROUPS_FILE, groups)
    elif eng:
        _engine_io(accelerator, folder, eng, save=True)
    if accelerator.is_main_process:
        if not eng:
            for i, model in enumerate(accelerator._models):
                entries[_indexed("model", i)] = save_model(
                    accelerator.unwrap_model(model), folder / _indexed("model", i)
                )
            for i, opt in enumerate(accelerator._optimizers):
                entries[_indexed("optimizer", i)] = save_tree(
                    folder / _indexed("optimizer", i), opt.state_dict()
                )
        for i, sched in enumerate(_schedulers(accelerator)):
            entries[f"scheduler_{i}.safetensors"] = save_tree(
                folder / f"scheduler_{i}.safetensors", sched.state_dict()
            )
        for i, obj in enumerate(accelerator._custom_objects):
            entries[f"custom_state_{i}.safetensors"] = save_tree(
                folder / f"custom_state_{i}.safetensors", obj.state_dict()
            )
        if accelerator.scaler is not None:
            entries["scaler.safetensors"] = save_tree(
                folder / "scaler.safetensors", accelerator.scaler.state_dict()
            )
    name = rng_file(accelerator.process_index)
    entries[name] = save_tree(folder / name, rng_state())
    return entries


def _engine_io(accelerator: Any, folder: Path, eng: str, save: bool) -> None:
    """The model and optimizer through the engine's own checkpoint functions (as ``save_state`` does)."""
    if eng == "deepspeed":
        for i, model in enumerate(accelerator._models):
            tag = "pytorch_model" if i == 0 else f"pytorch_model_{i}"
            model.save_checkpoint(str(folder), tag) if save else model.load_checkpoint(str(folder), tag)
        return
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

    plugin = accelerator.state.fsdp_plugin
    for i, model in enumerate(accelerator._models):
        (save_fsdp_model if save else load_fsdp_model)(plugin, accelerator, model, str(folder), i)
    for i, opt in enumerate(accelerator._optimizers):
        fn = save_fsdp_optimizer if save else load_fsdp_optimizer
        fn(plugin, accelerator, opt, accelerator._models[i], str(folder), i)


def read_state(accelerator: Any, folder: Path, files: set[str], legacy: bool = False) -> None:
    """Restore everything :func:`write_state` wrote (``legacy``: Accelerate's pickle layout, read with
    ``weights_only=True``). Raises :class:`StateFileError` naming the file that does not fit."""
    folder = Path(folder)
    load = _load_legacy if legacy else load_tree
    eng = engine(accelerator)
    if eng == "fully_shard":
        _read_sharded(accelerator, folder)
    elif eng:
        _engine_io(accelerator, folder, eng, save=False)
    else:
        from bert_mp.core.engine.sharding import SHARDED_DIR

        if (folder / SHARDED_DIR).is_dir():
            raise StateFileError(
                "it holds FSDP shards (sharded/): resume it under an FSDP launch "
                "(--config_file configs/accelerate/fsdp.yaml), or export it with bert-mp export"
            )
        for i, model in enumerate(accelerator._models):
            load_model(accelerator.unwrap_model(model), folder / _indexed("model", i))
        for i, opt in enumerate(accelerator._optimizers):
            name = _indexed("optimizer", i, "bin") if legacy else _indexed("optimizer", i)
            _apply(name, opt.load_state_dict, load(folder / name))
    for i, sched in enumerate(_schedulers(accelerator)):
        name = _indexed("scheduler", i, "bin") if legacy else f"scheduler_{i}.safetensors"
        _apply(name, sched.load_state_dict, load(folder / name))
    _read_custom(accelerator, folder, files, load, legacy)
    name = "scaler.pt" if legacy else "scaler.safetensors"
    if accelerator.scaler is not None and name in files:  # none saved: resumed into fp16, a fresh scale
        _apply(name, accelerator.scaler.load_state_dict, load(folder / name))
    rank = accelerator.process_index
    name = f"random_states_{rank}.pkl" if legacy else rng_file(rank)
    if name in files:
        _apply(
            name, set_rng_state, _load_legacy(folder / name, rng=True) if legacy else load_tree(folder / name)
        )
    else:
        warnings.warn(
            f"{folder}: no RNG state for process {rank} (saved by fewer processes); its random streams restart",
            BertMPWarning,
            stacklevel=2,
        )


def _read_sharded(accelerator: Any, folder: Path) -> None:
    """The model and optimizer of bert_mp's FSDP2 wrap, from the checkpoint's ``sharded/`` folder."""
    from bert_mp.core.engine.sharding import GROUPS_FILE, SHARDED_DIR, load_sharded

    if not (folder / SHARDED_DIR).is_dir():
        raise StateFileError(
            "it holds a whole model (model.safetensors), not shards: resume it under the launch that wrote "
            "it (without FSDP), or start this run afresh"
        )
    try:
        groups = load_tree(folder / GROUPS_FILE)
        load_sharded(accelerator._models[0], accelerator._optimizers[0], folder, groups)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AssertionError) as e:
        raise StateFileError(
            f"the sharded model and optimizer do not fit this run ({_first_line(e)})"
        ) from None


def _read_custom(accelerator: Any, folder: Path, files: set[str], load: Any, legacy: bool) -> None:
    objs = accelerator._custom_objects
    pattern = "custom_checkpoint_{}.pkl" if legacy else "custom_state_{}.safetensors"
    saved = sum(1 for i in range(len(files)) if pattern.format(i) in files)
    if saved != len(objs):
        raise StateFileError(
            f"it holds {saved} registered state objects, this run has {len(objs)} "
            f"({', '.join(type(o).__name__ for o in objs)}): it was written by another kind of run"
        )
    for i, obj in enumerate(objs):
        _apply(pattern.format(i), obj.load_state_dict, load(folder / pattern.format(i)))


def _apply(name: str, fn: Any, value: Any) -> None:
    """``fn(value)``; an error of the state's shape becomes a :class:`StateFileError` naming the file."""
    try:
        fn(value)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise StateFileError(f"{name} does not fit this run ({_first_line(e)})") from None


def _numpy_rng_globals() -> list[Any]:
    """What unpickling a NumPy RNG state (an array of uint32) needs besides torch's defaults."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "UInt32DType"):
        allowed.append(np.dtypes.UInt32DType)
    return allowed


def _load_legacy(path: Path, rng: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain values only (NumPy arrays for ``rng``)."""
    from torch.serialization import safe_globals

    try:
        with safe_globals(_numpy_rng_globals() if rng else []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for a forbidden global, RuntimeError for a torn file
        raise StateFileError(
            f"{path.name} was refused (not a plain state: {_first_line(e)}); nothing in it was executed"
        ) from None


def estimate_bytes(accelerator: Any) -> int:
    """Roughly what one checkpoint takes: the model's tensors and the optimizer's state tensors."""
    seen: set[tuple] = set()
    total = 0
    for model in accelerator._models:
        for t in accelerator.unwrap_model(model).state_dict().values():
            if _alias_key(t) not in seen:
                seen.add(_alias_key(t))
                total += _nbytes(t)
    for opt in accelerator._optimizers:
        for st in getattr(opt, "state", {}).values():
            total += sum(_nbytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return total
