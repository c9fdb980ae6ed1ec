"""The one place that maps ``fp32 | tf32 | bf16 | fp16`` to autocast, loss scaling and backend flags.

Nothing else in bert_mp branches on the precision name: the training loop asks the plan for an
autocast context, a scaler and the ``mixed_precision`` value for Accelerate, and records
``describe()`` (read back from torch after the flags were applied) in ``summary.json``.

Semantics:

- fp32: fp32 storage and math, TF32 explicitly off (CUDA matmul and cuDNN), matmul precision
  ``highest``.
- tf32: fp32 storage; CUDA matmuls/convolutions on TF32 tensor cores (Ampere or newer). A CPU has no
  TF32 units, so on CPU ``tf32`` is a clearly labelled analogue: oneDNN computes fp32 matmuls with
  bf16 inner products (``set_float32_matmul_precision("medium")``); it needs bf16 support.
- bf16: autocast to bfloat16, fp32 master weights, no loss scaling.
- fp16: autocast to float16, fp32 master weights, dynamic loss scaling. On CUDA Accelerate builds
  the GradScaler (``GradScalerKwargs``); on CPU Accelerate silently drops fp16, so we pass it
  ``mixed_precision="no"`` and install our own ``torch.amp.GradScaler("cpu")`` as
  ``accelerator.scaler`` (see :func:`install_scaler`).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import platform
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bert_mp.core.config.precision_modes import AMP_PRECISIONS, BF16_UPDATES, FP8_RECIPES, PRECISIONS  # noqa: F401
from bert_mp.errors import HardwareError

_AUTOCAST_DTYPE = {
    "fp32": None,
    "tf32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "bf16_pure": None,  # the weights themselves are bf16; losses are upcast to fp32 by the model
    "fp8": None,  # float8 Linears over fp32 master weights (bf16 autocast around them on CUDA)
}


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


CPU_MASK_ENV = "BERT_MP_CPU_MASK"
"""Environment variable that makes the CPU probes report less than the hardware has.

A comma-separated subset of ``amx``, ``fp16``, ``bf16`` (or ``all``): the suite, or any command, then
behaves as on a weaker CPU (e.g. ``BERT_MP_CPU_MASK=all``: an AVX2-only machine). Masking also caps
oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA``) when that is not set already, so the kernels that
run match what the probes report.
"""
CPU_FEATURES = ("amx", "fp16", "bf16")

CAPS_TRACE_ENV = "BERT_MP_CAPS_TRACE"
"""A file to which each decision that turns on this CPU's capabilities appends where it was taken.

The place is the running test (``PYTEST_CURRENT_TEST``, which the processes a test starts inherit) or,
at collection time, the test module that asked. ``scripts/test.sh`` sets it for the whole suite, then
runs exactly the places it lists again with every capability masked, so a test that branches on the
CPU is checked as on an AVX2-only machine wherever the suite runs. Unset: nothing is written.
"""

# The strongest oneDNN ISA that lacks each masked feature set (oneDNN's ISA names, ordered).
_ONEDNN_ISA_CAP = {
    frozenset({"amx"}): "AVX10_1_512",
    frozenset({"fp16"}): "AVX512_CORE_BF16",
    frozenset({"amx", "fp16"}): "AVX512_CORE_BF16",
}

EMULATION_SLOWDOWN = "emulated bf16/fp16 matmuls are ~15-70x slower than fp32"
FP8_EMULATION = "float8 casts and scales around fp32 matmuls prove numerics, never fp8 speed"
EMULATION_COST = f"{EMULATION_SLOWDOWN} (512x512 matmuls measured on AMD EPYC CPUs; see docs/precision.md)"


def cpu_mask() -> frozenset[str]:
    """The CPU features masked by ``BERT_MP_CPU_MASK``; raises on a name it does not know."""
    raw = os.environ.get(CPU_MASK_ENV, "").strip().lower()
    if not raw:
        return frozenset()
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(CPU_FEATURES)
    unknown = sorted(names - set(CPU_FEATURES))
    if unknown:
        raise HardwareError(
            f"{CPU_MASK_ENV}={raw!r}: unknown feature(s) {', '.join(unknown)}; "
            f"use a comma-separated subset of {', '.join(CPU_FEATURES)}, or all"
        )
    return frozenset(names)


def onednn_isa_cap(mask: frozenset[str]) -> str | None:
    """``ONEDNN_MAX_CPU_ISA`` value that hides the masked features from oneDNN (None: no cap)."""
    if not mask:
        return None
    if "bf16" in mask:  # no bf16 implies no AMX (its tiles are bf16/int8) and no fp16 kernels
        return "AVX512_CORE_VNNI"
    return _ONEDNN_ISA_CAP[frozenset(mask)]


def apply_cpu_mask_to_onednn() -> None:
    """Cap oneDNN's ISA to match the mask; effective before oneDNN's first kernel in this process."""
    cap = onednn_isa_cap(cpu_mask())
    if cap is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", cap)


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and "amx_tile" in line for line in f)
    except OSError:
        return False


@dataclass(frozen=True)
class CpuCapabilities:
    """What this CPU offers for reduced precision, after ``BERT_MP_CPU_MASK``."""

    bf16: bool
    """Native bf16 dot products (AVX512-BF16 or AMX)."""
    fp16: bool
    """Native fp16 arithmetic in oneDNN (AVX512-FP16 or AMX-FP16)."""
    amx: bool
    """AMX tiles."""
    masked: tuple[str, ...] = ()
    """Features hidden by ``BERT_MP_CPU_MASK``."""

    def has(self, precision: str) -> bool:
        """Whether ``precision`` runs natively (fp32 always; tf32's CPU analogue needs bf16)."""
        native = {"fp32": True, "tf32": self.bf16, "bf16": self.bf16, "fp16": self.fp16}
        native.update(bf16_pure=self.bf16, fp8=False)  # no CPU has float8 matmuls
        return native[precision]

    def as_dict(self) -> dict[str, Any]:
        return {"bf16": self.bf16, "fp16": self.fp16, "amx": self.amx, "masked": list(self.masked)}


def _trace_capability_decision() -> None:
    """Append where a capability decision was taken to ``BERT_MP_CAPS_TRACE`` (see there)."""
    path = os.environ.get(CAPS_TRACE_ENV)
    if not path:
        return
    where = os.environ.get("PYTEST_CURRENT_TEST", "")
    if not where:  # a test module asking while it is collected (a skip condition)
        frame = sys._getframe(1)
        while frame is not None and not os.path.basename(frame.f_code.co_filename).startswith("test_"):
            frame = frame.f_back
        if frame is None:
            return
        where = f"{os.path.relpath(frame.f_code.co_filename)} (collect)"
    with open(path, "a", encoding="utf-8") as f:  # one short line: appends from many processes stay whole
        f.write(where + "\n")


def cpu_capabilities() -> CpuCapabilities:
    """Probe oneDNN (and /proc/cpuinfo for AMX), then apply ``BERT_MP_CPU_MASK``.

    Every call counts as a decision that turns on the CPU (``BERT_MP_CAPS_TRACE``); the record a run
    writes into summary.json reads :func:`_probe_capabilities` instead."""
    _trace_capability_decision()
    return _probe_capabilities()


def _probe_capabilities() -> CpuCapabilities:
    mask = cpu_mask()
    # Masking bf16 hides fp16 and AMX too: every CPU with native fp16 or AMX also has bf16, and the
    # oneDNN ISA cap for "no bf16" excludes both.
    return CpuCapabilities(
        bf16=_cpu_supports_bf16() and "bf16" not in mask,
        fp16=_cpu_supports_fp16() and not ({"fp16", "bf16"} & mask),
        amx=_has_amx() and not ({"amx", "bf16"} & mask),
        masked=tuple(sorted(mask)),
    )


def _cpu_supports_bf16() -> bool:
    """oneDNN reports whether the CPU has native bf16 (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _cpu_supports_fp16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def device_name(device: torch.device) -> str:
    """A human-readable device name (GPU model or CPU model string)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose numerics matter for a run."""
    import accelerate
    import datasets
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        **_optional_versions(),
    }


def _optional_versions() -> dict[str, str]:
    """Versions of the optimizer and float8 libraries (read from their metadata, not imported)."""
    from importlib import metadata

    out = {}
    for dist in ("torchao", "torch-optimi", "pytorch_optimizer"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


@dataclass(frozen=True)
class PrecisionPlan:
    """What one precision mode means on one device; build it with :func:`resolve_precision`."""

    name: str
    device: torch.device
    autocast_dtype: torch.dtype | None
    use_scaler: bool
    init_scale: float = 65536.0
    growth_interval: int = 2000
    emulated: bool = False
    """True when a CPU without native bf16/fp16 runs the mode through torch's emulation (and for fp8
    wherever the device has no float8 matmuls: the numerics of fp8, never its speed)."""
    bf16_update: str = "kahan"
    """bf16_pure: kahan | stochastic | none (see :mod:`bert_mp.core.numerics.bf16_updates`)."""
    fp8_recipe: str = "tensorwise"
    fp8_convert_heads: bool = False
    layernorm: str = "fp32"
    """Under autocast: ``fp32`` (autocast's own LayerNorm: fp32 output, an fp32 residual stream) |
    ``autocast`` (the same fp32 math, output in the autocast dtype: a 16-bit residual stream; see
    :mod:`bert_mp.core.numerics.autocast_norms`). Resolved from ``layernorm_precision`` by
    :func:`resolve_layernorm`."""

    @property
    def param_dtype(self) -> torch.dtype:
        """Storage dtype of weights, gradients and optimizer states."""
        return torch.bfloat16 if self.name == "bf16_pure" else torch.float32

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put an fp32 model in this mode's storage: bf16 for bf16_pure, float8 Linears for fp8."""
        if self.name == "bf16_pure":
            return model.to(torch.bfloat16)
        if self.name == "fp8":
            from bert_mp.core.numerics.fp8 import convert_fp8

            convert_fp8(model, self.fp8_recipe, emulate=self.emulated, heads=self.fp8_convert_heads)
        if self.layernorm == "autocast":
            from bert_mp.core.numerics.autocast_norms import install_autocast_layernorm

            install_autocast_layernorm(model)
        return model

    @property
    def accelerate_mixed_precision(self) -> str:
        """Value for ``Accelerator(mixed_precision=...)``.

        Only CUDA gets Accelerate's own amp; on CPU Accelerate would silently ignore fp16, so the
        plan's :meth:`autocast` and :meth:`make_scaler` do the work there.
        """
        if self.device.type == "cuda" and self.autocast_dtype is not None:
            return "bf16" if self.autocast_dtype == torch.bfloat16 else "fp16"
        return "no"

    @property
    def matmul_precision(self) -> str:
        """``torch.set_float32_matmul_precision`` value for this mode."""
        if self.name == "tf32":
            return "high" if self.device.type == "cuda" else "medium"
        return "highest"

    def apply_backend_flags(self) -> None:
        """Set the fp32 matmul / cuDNN flags every time (a previous run in the process may differ)."""
        tf32 = self.name == "tf32" and self.device.type == "cuda"
        # Only the legacy flag API is used: torch refuses to read precision once legacy and new
        # (fp32_precision) APIs were mixed.
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.set_float32_matmul_precision(self.matmul_precision)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast context for the forward pass (a no-op context in fp32 / tf32)."""
        if self.name == "fp8" and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)  # the ops float8 does not cover
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A dynamic GradScaler for fp16 on a device where Accelerate does not build one, else None."""
        if not self.use_scaler or self.accelerate_mixed_precision == "fp16":
            return None
        return torch.amp.GradScaler(
            self.device.type, init_scale=self.init_scale, growth_interval=self.growth_interval
        )

    def accelerate_kwargs_handlers(self) -> list[Any]:
        """Kwargs handlers for ``Accelerator``: the fp16 scaler settings when Accelerate owns the scaler."""
        if self.accelerate_mixed_precision != "fp16":
            return []
        from accelerate.utils import GradScalerKwargs

        return [GradScalerKwargs(init_scale=self.init_scale, growth_interval=self.growth_interval)]

    def describe(self, scaler: torch.amp.GradScaler | None = None) -> dict[str, Any]:
        """What actually took effect, read back from torch (call after :meth:`apply_backend_flags`)."""
        matmul_flags: dict[str, Any] = {
            "float32_matmul_precision": _safe(torch.get_float32_matmul_precision),
            "cuda_matmul_allow_tf32": _safe(lambda: torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": _safe(lambda: torch.backends.cudnn.allow_tf32),
            "mkldnn_matmul_fp32_precision": _safe(lambda: torch.backends.mkldnn.matmul.fp32_precision),
        }
        note = {
            "fp32": "strict fp32: TF32 off, highest matmul precision",
            "tf32": "TF32 tensor cores for fp32 matmuls/convolutions",
            "bf16": "autocast bfloat16, fp32 master weights, no loss scaling",
            "fp16": "autocast float16, fp32 master weights, dynamic loss scaling",
            "bf16_pure": f"bf16 weights, gradients and optimizer states, no fp32 master copy; "
            f"updates: {self.bf16_update}",
            "fp8": f"torchao float8 Linears ({self.fp8_recipe} scaling) over fp32 master weights",
        }[self.name]
        if self.name == "tf32" and self.device.type == "cpu":
            note = (
                "CPU analogue of tf32 (no TF32 hardware on CPU): oneDNN fp32 matmuls with bf16 inner products"
            )
        if self.layernorm == "autocast":
            note += f"; LayerNorm outputs in {str(self.autocast_dtype).replace('torch.', '')} (16-bit residual stream)"
        if self.emulated and self.name == "fp8":
            note += " (emulated: float8 numerics through fp32 matmuls, not fp8 speed)"
        elif self.emulated:
            note += " (emulated: this CPU has no native support, hardware.allow_emulated=true)"
        out: dict[str, Any] = {
            "name": self.name,
            "device": str(self.device),
            "device_name": device_name(self.device),
            "autocast_dtype": str(self.autocast_dtype).replace("torch.", "") if self.autocast_dtype else None,
            "accelerate_mixed_precision": self.accelerate_mixed_precision,
            "loss_scaler": self.use_scaler,
            "init_scale": self.init_scale if self.use_scaler else None,
            "growth_interval": self.growth_interval if self.use_scaler else None,
            "scaler_scale": float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None,
            "matmul": matmul_flags,
            "emulated": self.emulated,
            "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "bf16_update": self.bf16_update if self.name == "bf16_pure" else None,
            "fp8_recipe": self.fp8_recipe if self.name == "fp8" else None,
            "layernorm": self.layernorm if self.autocast_dtype is not None else None,
            "note": note,
            "versions": library_versions(),
        }
        if self.device.type == "cpu":
            out["cpu_capabilities"] = _probe_capabilities().as_dict()
        if self.device.type == "cuda":
            out["cuda_capability"] = ".".join(map(str, _cuda_capability(self.device)))
        return out


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except (RuntimeError, AttributeError) as e:
        return f"unreadable: {e}"


_warned_emulated: set[str] = set()


def _cpu_check(name: str, key: str, caps: CpuCapabilities, allow_emulated: bool) -> bool:
    """Refuse a precision this CPU lacks (unless emulation is allowed); returns whether it is emulated."""
    masked = f" (masked by {CPU_MASK_ENV})" if caps.masked else ""
    if name == "tf32" and not caps.bf16:
        # oneDNN ignores its bf16 fp32-math mode without native bf16: the "analogue" would be fp32.
        raise HardwareError(
            f"{key}=tf32: the CPU tf32 analogue (oneDNN fp32 matmuls with bf16 inner products) needs a "
            f"CPU with native bf16 (AVX512-BF16 or AMX); this CPU has none{masked}, and without it "
            f"oneDNN computes plain fp32, so there is nothing to emulate. Use {key}=fp32."
        )
    if caps.has(name):
        return False
    feature = {"bf16": "native bf16 (AVX512-BF16 or AMX)", "fp16": "native fp16 (AVX512-FP16 or AMX-FP16)"}
    feature.update(bf16_pure=feature["bf16"], fp8="float8 matmuls (no CPU has them)")
    if not allow_emulated:
        raise HardwareError(
            f"{key}={name} on CPU needs {feature[name]}; this CPU has none{masked}. "
            f"torch can emulate it, but {EMULATION_COST}. Set hardware.allow_emulated=true to run it "
            f"anyway (for numerics, not speed), or use {key}=fp32."
        )
    if name not in _warned_emulated and os.environ.get("LOCAL_RANK", "0") == "0":
        _warned_emulated.add(name)
        print(
            f"bert-mp: warning: {key}={name} is emulated on this CPU (no {feature[name]}{masked}): "
            f"the numerics of {name}, but {EMULATION_SLOWDOWN if name != 'fp8' else FP8_EMULATION}.",
            file=sys.stderr,
            flush=True,
        )
    return True


def resolve_precision(
    name: str,
    device: torch.device,
    init_scale: float = 65536.0,
    growth_interval: int = 2000,
    *,
    allow_emulated: bool = False,
    key: str = "train.precision",
    bf16_update: str = "kahan",
    fp8_recipe: str = "tensorwise",
    fp8_convert_heads: bool = False,
    layernorm: str = "auto",
    layernorm_key: str = "train.layernorm_precision",
) -> PrecisionPlan:
    """Check that ``device`` can run precision ``name`` and return its plan.

    Raises HardwareError with what to do instead when the hardware lacks the mode. On a CPU without
    native bf16/fp16, ``allow_emulated`` (``hardware.allow_emulated``) runs bf16/fp16 anyway, through
    torch's emulation, with a one-line warning; ``key`` names the config key in messages.
    ``layernorm``: ``auto | fp32 | autocast`` (see :func:`resolve_layernorm`).
    """
    if name not in PRECISIONS:
        raise HardwareError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    emulated = False
    if name == "fp8":
        from bert_mp.core.numerics.fp8 import check_torchao

        check_torchao(key)
    if device.type == "cuda":
        major, minor = _cuda_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        emulated = name == "fp8" and (major, minor) < (8, 9)  # float8 tensor cores: Ada / Hopper on
        if name in ("tf32", "bf16", "bf16_pure") and major < 8:
            raise HardwareError(
                f"{key}={name} needs an NVIDIA GPU with compute capability >= 8.0 (Ampere or "
                f"newer); this is {gpu}. Use {key}=fp16 or fp32."
            )
        if name == "fp16" and major < 7:
            raise HardwareError(
                f"{key}=fp16 needs tensor cores (compute capability >= 7.0); this is {gpu}. Use {key}=fp32."
            )
    elif device.type == "cpu":
        caps = cpu_capabilities() if name != "fp32" else _probe_capabilities()  # fp32 runs on every CPU
        emulated = _cpu_check(name, key, caps, allow_emulated)
    elif name != "fp32":
        raise HardwareError(f"{key}={name} is only supported on CUDA and CPU, not {device.type}; use fp32.")
    return PrecisionPlan(
        name=name,
        device=device,
        layernorm=resolve_layernorm(layernorm, name, device, layernorm_key),
        autocast_dtype=_AUTOCAST_DTYPE[name],
        use_scaler=name == "fp16",
        init_scale=float(init_scale),
        growth_interval=int(growth_interval),
        emulated=emulated,
        bf16_update=bf16_update,
        fp8_recipe=fp8_recipe,
        fp8_convert_heads=fp8_convert_heads,
    )


LAYERNORM_AUTO: dict[str, str] = {"cuda": "fp32", "cpu": "fp32"}
"""What ``layernorm_precision=auto`` picks under autocast, per device type: a measured choice
(docs/gpu.md), not a habit."""


def resolve_layernorm(setting: str, precision: str, device: torch.device, key: str) -> str:
    """``fp32 | autocast`` for a precision on a device: ``auto`` takes :data:`LAYERNORM_AUTO` under
    autocast (bf16 / fp16) and ``fp32`` otherwise; ``autocast`` without autocast is refused."""
    from bert_mp.core.numerics.autocast_norms import LAYERNORM_PRECISIONS

    if setting not in LAYERNORM_PRECISIONS:
        raise HardwareError(f"{key}={setting!r}; choose one of {', '.join(LAYERNORM_PRECISIONS)}")
    under_autocast = _AUTOCAST_DTYPE[precision] is not None
    if setting == "autocast" and not under_autocast:
        raise HardwareError(
            f"{key}=autocast rounds LayerNorm outputs to autocast's dtype, and precision {precision} has no "
            f"autocast; use it with bf16 or fp16, or set {key}=auto"
        )
    if setting == "auto":
        return LAYERNORM_AUTO.get(torch.device(device).type, "fp32") if under_autocast else "fp32"
    return setting


def install_scaler(accelerator: Any, plan: PrecisionPlan) -> torch.amp.GradScaler | None:
    """Give ``accelerator`` the plan's scaler (before ``prepare``) and return the scaler in use.

    With the scaler installed as ``accelerator.scaler``, ``accelerator.backward`` scales the loss, the
    prepared optimizer steps through ``scaler.step`` / ``update`` and ``save_state`` checkpoints it.
    """
    own = plan.make_scaler()
    if own is not None:
        accelerator.scaler = own
    return accelerator.scaler


def accelerate_unscales(accelerator: Any) -> bool:
    """Whether Accelerate unscales the gradients itself, inside ``clip_grad_norm_``: only for its own
    native fp16 amp (CUDA). Our CPU scaler (:func:`install_scaler`) is unscaled by the step instead."""
    return bool(accelerator.native_amp and accelerator.mixed_precision == "fp16")


@contextlib.contextmanager
def backend_flags(plan: PrecisionPlan) -> Iterator[None]:
    """Apply a plan's backend flags for a block and restore the previous ones afterwards."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    plan.apply_backend_flags()
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


def inductor_cache_of_its_own() -> None:
    """Under ``ATEN_CPU_CAPABILITY`` (ATen's kernels as on a weaker CPU, e.g. ``avx2`` with
    ``BERT_MP_CPU_MASK=all``), a cache of inductor's own: its cache is not keyed by that variable,
    although its CPU code follows it, and a compiled step that reused the kernels built for the
    machine's own vector width stopped with ``index out of bounds`` (torch 2.13.0, ``avx2`` on an
    AVX512 EPYC; the same step passed with a fresh cache). The folder is inductor's default one with
    ``_aten_<capability>`` appended. ``TORCHINDUCTOR_CACHE_DIR`` naming another folder is the user's
    choice and left alone; naming the default one it is replaced, since inductor writes its default
    there itself when first asked (importing transformers does), and it reads the variable at every
    use."""
    cap = re.sub(r"[^a-z0-9]+", "_", os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()).strip("_")
    if not cap:
        return
    try:  # inductor's default folder (torch._inductor.runtime.cache_dir_utils, whose import costs seconds)
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != default:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_aten_{cap}"


# The mask caps oneDNN before its first kernel; a bad mask is reported by cpu_capabilities().
with contextlib.suppress(HardwareError):
    apply_cpu_mask_to_onednn()
inductor_cache_of_its_own()
