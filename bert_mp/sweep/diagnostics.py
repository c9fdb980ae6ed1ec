"""Diagnostics a user needs to choose a precision: speed ladder, memory, kernel check, fp16 health.

Two kinds of functions live here. Pure ones summarise what the training runs recorded
(``summary.json`` and ``metrics.jsonl``): the speed ladder, the fp16 loss-scale trajectory, the
theoretical bytes per parameter, dimensions that miss the fast path. ``probe_precision`` runs a
short forward/backward pass of the sweep's model in this process to measure what the run folders
cannot show: parameter-state and activation bytes, and which matrix-multiply kernels ran.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

# re-exported: the kernel check's public names have always been importable from here
from bert_mp.sweep.cuda_kernels import (  # noqa: F401
    TENSOR_CORE_SHARE_MIN,
    classify_cuda_kernel,
    cuda_kernel_kind,
    cuda_kernel_verdict,
    strict_fp32_flags,
    summarize_cuda_kernels,
)

if TYPE_CHECKING:  # the probes import torch when they run: `bert-mp report` needs none of it
    import torch

# --------------------------------------------------------------------------------------------------
# speed ladder and fp16 health (from the run folders)
# --------------------------------------------------------------------------------------------------


def speed_ladder(runs: Sequence[dict[str, Any]], reference: str = "fp32") -> list[dict[str, Any]]:
    """One row per run with a summary: step ms, tokens/s, speed-up versus ``reference``, MFU.

    ``runs`` items have ``name``, ``precision`` and ``summary`` (the run's summary.json). The
    speed-up is a ratio of tokens/s measured in the same sweep on the same machine.
    """
    ref_tps = None
    for r in runs:
        if r["name"] == reference:
            ref_tps = (r.get("summary") or {}).get("throughput", {}).get("tokens_per_sec")
    rows = []
    for r in runs:
        thr = (r.get("summary") or {}).get("throughput") or {}
        tps = thr.get("tokens_per_sec")
        rows.append(
            {
                "name": r["name"],
                "precision": r["precision"],
                "step_ms": thr.get("step_ms"),
                "tokens_per_sec": tps,
                "speedup_vs_fp32": (tps / ref_tps) if tps and ref_tps else None,
                "mfu": thr.get("mfu"),
            }
        )
    return rows


def loss_scale_health(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """fp16 loss-scale trajectory and skipped steps from metrics.jsonl rows (None without a scaler)."""
    traj = [
        (int(r["step"]), float(r["amp/loss_scale"]))
        for r in rows
        if r.get("kind") == "train" and r.get("amp/loss_scale") is not None
    ]
    if not traj:
        return None
    skipped = [r.get("amp/skipped_steps") for r in rows if r.get("kind") == "train"]
    skipped = [int(s) for s in skipped if s is not None]
    drops = sum(1 for (_, a), (_, b) in zip(traj, traj[1:]) if b < a)
    return {
        "trajectory": traj,
        "initial_scale": traj[0][1],
        "final_scale": traj[-1][1],
        "min_scale": min(s for _, s in traj),
        "max_scale": max(s for _, s in traj),
        "scale_drops": drops,
        "skipped_steps": max(skipped) if skipped else 0,
    }


# --------------------------------------------------------------------------------------------------
# memory: bytes per parameter (theory) next to what was measured
# --------------------------------------------------------------------------------------------------


def bytes_per_parameter(precision: str) -> dict[str, float]:
    """Bytes of parameter state per parameter under AdamW for one precision mode.

    Autocast keeps the fp32 weights as the master copy and makes transient 2-byte copies for the
    matmuls, so bf16 / fp16 hold as much parameter state as fp32: mixed precision saves
    activation memory (and time), not parameter state.
    """
    if precision == "bf16_pure":
        return bf16_pure_bytes_per_parameter()
    low = precision in ("bf16", "fp16", "fp8")
    state = {
        "weights": 4.0,
        "gradients": 4.0,
        "optimizer_state": 8.0,  # AdamW exp_avg + exp_avg_sq in fp32
        "fp32_master_copy": 0.0,  # under autocast the fp32 weights *are* the master copy
        "low_precision_weight_copies": (1.0 if precision == "fp8" else 2.0)
        if low
        else 0.0,  # cast cache, freed after the step
    }
    # persistent state only; the transient copies live in the activation budget of a step
    state["total"] = sum(v for k, v in state.items() if k != "low_precision_weight_copies")
    return state


def bf16_pure_bytes_per_parameter(kahan: bool = True) -> dict[str, float]:
    """bf16_pure under AdamW: 2-byte weights, gradients and moments, no fp32 master copy; Kahan
    summation adds one 2-byte compensation per weight (16 -> 10 bytes: 37.5% less than autocast)."""
    state = {
        "weights": 2.0,
        "gradients": 2.0,
        "optimizer_state": 4.0 + (2.0 if kahan else 0.0),
        "fp32_master_copy": 0.0,
        "low_precision_weight_copies": 0.0,
    }
    state["total"] = sum(v for k, v in state.items() if k != "low_precision_weight_copies")
    return state


def _unique_storage_bytes(tensors: Sequence[torch.Tensor], exclude: set[int]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in exclude or ptr == 0:
            continue
        seen[ptr] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _saved_tensors(into: list[torch.Tensor]) -> Iterator[None]:
    """Collect every tensor autograd saves for the backward pass (the activation memory)."""
    import torch

    def pack(t: torch.Tensor) -> torch.Tensor:
        into.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


# --------------------------------------------------------------------------------------------------
# kernel check
# --------------------------------------------------------------------------------------------------


MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
)
"""Profiler leaf operators that are matrix multiplies (or fused attention built on them)."""

_ONEDNN_LINE = re.compile(r"^onednn_verbose,(?:v\d+,)?primitive,exec,cpu,(?P<kind>[a-z_]+),(?P<impl>[^,]+),")
_ONEDNN_SRC = re.compile(r"src(?:_[a-z]+)?:(?P<dtype>[a-z0-9]+):")
_ONEDNN_FPMATH = re.compile(r"attr-fpmath:(?P<fpmath>[a-z0-9]+)")


def parse_onednn_verbose(text: str) -> list[dict[str, Any]]:
    """Matmul / inner-product executions from ``ONEDNN_VERBOSE`` output, grouped by implementation.

    Each entry: ``impl`` (e.g. ``brg_matmul:avx10_1_512_amx``), ``src_dtype``, ``fpmath`` (the
    internal math mode oneDNN was allowed, e.g. ``bf16`` for fp32 inputs at matmul precision
    "medium"), ``count`` and ``class``: ``amx`` (AMX tiles), ``avx512-bf16/fp16`` (AVX-512 reduced-precision dot products)
    or ``fp32`` (no reduced-precision hardware path).
    """
    groups: dict[tuple[str, str, str], int] = {}
    for line in text.splitlines():
        m = _ONEDNN_LINE.match(line.strip())
        if not m or m.group("kind") not in ("matmul", "inner_product", "convolution"):
            continue
        src = _ONEDNN_SRC.search(line)
        fpmath = _ONEDNN_FPMATH.search(line)
        key = (m.group("impl"), src.group("dtype") if src else "?", fpmath.group("fpmath") if fpmath else "")
        groups[key] = groups.get(key, 0) + 1
    out = []
    for (impl, dtype, fpmath), count in sorted(groups.items(), key=lambda kv: -kv[1]):
        if "amx" in impl:
            cls = "amx"
        elif dtype in ("bf16", "f16"):
            cls = f"avx512-{'bf16' if dtype == 'bf16' else 'fp16'}"
        else:
            cls = "fp32"
        out.append({"impl": impl, "src_dtype": dtype, "fpmath": fpmath, "count": count, "class": cls})
    return out


@contextlib.contextmanager
def _capture_fd1(sink: list[str]) -> Iterator[None]:
    """Capture what C code writes to file descriptor 1 (oneDNN prints its verbose log there)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode("utf-8", "replace"))


def _profiled_matmuls(prof: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ops: dict[tuple[str, str], dict[str, Any]] = {}
    kernels: dict[str, dict[str, Any]] = {}
    for e in prof.events():
        if e.name in MATMUL_OPS:
            shapes = str([s for s in (e.input_shapes or []) if s])
            row = ops.setdefault(
                (e.name, shapes), {"op": e.name, "input_shapes": shapes, "count": 0, "cpu_us": 0.0}
            )
            row["count"] += 1
            row["cpu_us"] += e.cpu_time
        dev_type = getattr(e, "device_type", None)
        if dev_type is not None and str(dev_type).endswith("CUDA"):
            cls = classify_cuda_kernel(e.name)
            if cls is not None:
                k = kernels.setdefault(
                    e.name,
                    {
                        "kernel": e.name,
                        "kind": cuda_kernel_kind(e.name),
                        "class": cls,
                        "count": 0,
                        "device_us": 0.0,
                    },
                )
                k["count"] += 1
                k["device_us"] += getattr(e, "device_time", 0.0) or 0.0
    return (
        sorted(ops.values(), key=lambda r: -r["cpu_us"]),
        sorted(kernels.values(), key=lambda r: -r["device_us"]),
    )


def kernel_verdict(
    precision: str,
    device_type: str,
    onednn: Sequence[dict],
    cuda_kernels: Sequence[dict],
    flags: dict[str, Any] | None = None,
) -> str:
    """One sentence: did the matmuls take the reduced-precision hardware path this mode is for?"""
    if device_type == "cuda":
        return cuda_kernel_verdict(precision, cuda_kernels, flags)["text"]
    amx = sum(r["count"] for r in onednn if r["class"] == "amx")
    low = sum(r["count"] for r in onednn if r["class"] != "fp32")
    total = sum(r["count"] for r in onednn)
    if precision == "fp32":
        if low:
            return f"{low} oneDNN matmuls ran in reduced precision: strict fp32 is not strict"
        return "fp32 matmuls ran outside oneDNN's reduced-precision paths (MKL/oneDNN fp32)"
    if not total:
        return "no oneDNN matmul primitive ran: these matmuls went to the fp32 BLAS path"
    return f"{amx}/{total} oneDNN matmuls on AMX tiles, {low - amx} on AVX-512 reduced precision"


# --------------------------------------------------------------------------------------------------
# dimensions
# --------------------------------------------------------------------------------------------------


def dimension_flags(dims: dict[str, int], multiple: int = 8) -> list[str]:
    """Names of dimensions that are not multiples of ``multiple`` (they miss tensor-core / AMX tiles)."""
    return [
        f"{name}={value} is not a multiple of {multiple}"
        for name, value in dims.items()
        if value is not None and int(value) % multiple
    ]


def model_dimensions(bert_cfg: Any, micro_batch_size: int, max_seq_length: int) -> dict[str, int]:
    """The dimensions that set matmul shapes in BERT pretraining."""
    return {
        "hidden_size": bert_cfg.hidden_size,
        "intermediate_size": bert_cfg.intermediate_size,
        "head_dim": bert_cfg.hidden_size // bert_cfg.num_attention_heads,
        "vocab_size": bert_cfg.vocab_size,
        "micro_batch_size": micro_batch_size,
        "max_seq_length": max_seq_length,
    }


# --------------------------------------------------------------------------------------------------
# the probe: one short measured + profiled pass per precision
# --------------------------------------------------------------------------------------------------


def synthetic_batch(
    vocab_size: int,
    batch: int,
    seq: int,
    device: torch.device,
    seed: int = 0,
    padded: bool = True,
    max_predictions: int = 20,
) -> dict[str, torch.Tensor]:
    """A pretraining batch shaped like the collator's: 15% of real positions labelled (at most
    ``max_predictions`` per row).

    ``padded`` (default) gives rows of different lengths padded to ``seq`` (the first row full, a
    tenth short as with BERT's ``short_seq_prob``, the rest between half and full length), so the
    attention kernels profiled are the ones a padded training batch gets; ``padded=False`` gives
    full-length rows only.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (batch, seq), generator=g)
    lengths = torch.full((batch,), seq)
    if padded and batch > 1:
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
        short = torch.rand(batch, generator=g) < 0.1
        lengths[short] = torch.randint(8, max(9, seq // 2), (int(short.sum()),), generator=g)
        lengths[0] = seq
        lengths = lengths.clamp(min=min(8, seq), max=seq)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0
    labels = torch.full((batch, seq), -100)
    chosen = (torch.rand((batch, seq), generator=g) < 0.15) & mask.bool()
    chosen[:, 1] = True
    chosen &= chosen.cumsum(dim=1) <= max_predictions  # at most max_predictions per row, like the masking
    labels[chosen] = ids[chosen]
    tt = torch.zeros((batch, seq), dtype=torch.long)
    tt[:, seq // 2 :] = 1
    tt = tt * mask
    out = {
        "input_ids": ids,
        "token_type_ids": tt,
        "attention_mask": mask,
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (batch,), generator=g),
    }
    return {k: v.to(device) for k, v in out.items()}


def _probe_optimizer(model: torch.nn.Module, loop_cfg: Any, device: torch.device) -> Any:
    import torch

    if loop_cfg is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    import dataclasses

    from bert_mp.core.numerics.optimizers import build_optimizer

    return build_optimizer(model, dataclasses.replace(loop_cfg, learning_rate=1e-4), device)


def _parameter_state_bytes(params: list[torch.Tensor], opt: Any) -> tuple[int, int, int, int]:
    """Parameters, and the bytes of weights, gradients and optimizer state."""
    import torch

    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    optim = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    return sum(p.numel() for p in params), weights, grads, optim


def _profile(step: Any, device: torch.device, steps: int) -> tuple[Any, list[str]]:
    """Run ``steps`` steps under the profiler (and oneDNN's verbose log on CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    verbose: list[str] = []
    onednn_ctx: Any = contextlib.nullcontext()
    if device.type == "cpu":
        onednn_ctx = torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON)
    with _capture_fd1(verbose), onednn_ctx, profile(activities=activities, record_shapes=True) as prof:
        for _ in range(max(1, steps)):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # make sure every kernel of the profiled steps is recorded
    return prof, verbose


def _probe_scaler(plan: Any, device: torch.device) -> Any:
    """The loss scaler the probe's step uses: the plan's on CPU, CUDA's own GradScaler on CUDA."""
    import torch

    if not plan.use_scaler:
        return None
    return torch.amp.GradScaler("cuda") if device.type == "cuda" else plan.make_scaler()


def _state_bytes_fields(
    precision: str, n_params: int, weights: int, grads: int, optim: int, activations: int
) -> dict[str, Any]:
    """The probe's measured state bytes, per parameter too, beside the theory for ``precision``."""
    return {
        "parameters": n_params,
        "measured_bytes": {
            "weights": weights,
            "gradients": grads,
            "optimizer_state": optim,
            "activations_saved_for_backward": activations,
        },
        "measured_bytes_per_parameter": {
            "weights": weights / n_params,
            "gradients": grads / n_params,
            "optimizer_state": optim / n_params,
        },
        "theory_bytes_per_parameter": bytes_per_parameter(precision),
    }


def probe_precision(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    plan: Any,
    steps: int = 2,
    loop_cfg: Any = None,
) -> dict[str, Any]:
    """Measure parameter-state and activation bytes and profile the matmul kernels of one precision.

    ``model`` returns the loss sums of ``bert_mp.model.bert.PretrainingModel``; ``plan`` is a
    ``PrecisionPlan``. Activation bytes are the unique storages autograd saved for backward in one
    step (exact on any device). Runs an optimizer step so its state exists when measured: the run's
    (``loop_cfg``: a ``train`` section), else AdamW. The model is put in the plan's storage first
    (bf16 weights for bf16_pure, float8 Linears for fp8).
    """
    import torch

    from bert_mp.core.numerics.precision import backend_flags

    device = next(model.parameters()).device
    model = plan.prepare_model(model)
    opt = _probe_optimizer(model, loop_cfg, device)
    scaler = _probe_scaler(plan, device)

    def step(saved: list[torch.Tensor] | None = None) -> None:
        ctx = _saved_tensors(saved) if saved is not None else contextlib.nullcontext()
        with ctx, plan.autocast():
            out = model(**batch)
            loss = (
                out["mlm_loss_sum"] / out["mlm_count"].clamp(min=1) + out["nsp_loss_sum"] / out["nsp_count"]
            )
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=False)

    with backend_flags(plan):
        model.train()
        saved: list[torch.Tensor] = []
        step(saved)
        params = list(model.parameters())
        n_params, weights, grads, optim = _parameter_state_bytes(params, opt)
        activations = _unique_storage_bytes(saved, exclude={p.untyped_storage().data_ptr() for p in params})
        saved.clear()
        flags = {  # what is in force while profiling: decides opaque kernels of strict fp32
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
        prof, verbose = _profile(step, device, steps)
    ops, cuda_kernels = _profiled_matmuls(prof)
    onednn = parse_onednn_verbose("".join(verbose)) if device.type == "cpu" else []
    return {
        "precision": plan.name,
        "device": str(device),
        **_state_bytes_fields(plan.name, n_params, weights, grads, optim, activations),
        "matmul_ops": ops[:15],
        "cuda_kernels": cuda_kernels[:25],
        "onednn_matmuls": onednn,
        "kernel_verdict": kernel_verdict(plan.name, device.type, onednn, cuda_kernels, flags),
        "cuda_kernel_check": cuda_kernel_verdict(plan.name, cuda_kernels, flags)
        if device.type == "cuda"
        else None,
        "matmul_flags": flags,
        "batch_padding_fraction": 1.0 - float(batch["attention_mask"].float().mean()),
        "profiled_steps": max(1, steps),
    }
