"""Which CUDA kernels ran a product, and on what hardware: tensor cores, CUDA cores, skinny-GEMM
kernels. A profile's kernel names go in; a verdict per precision comes out, weighted by device time."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# Kernel names are evidence, not proof; the patterns below follow the names cuBLAS, cuBLASLt (nvjet),
# CUTLASS, cuDNN and the SDPA backends give their kernels. Order matters: CUDA-core markers win,
# because strict-fp32 cuBLAS kernels on Ampere/Hopper are called ``sm80_xmma_gemm_f32f32_f32f32_..._ffma``
# and ``cutlass_80_simt_sgemm_...`` - names that also contain "xmma" / "cutlass" / "sm80_".
_ATTENTION = re.compile(r"(flash|fmha|attention|attn|sdpa|mem_eff)", re.IGNORECASE)
_CUDA_GEMM = re.compile(r"(gemm|gemv|gemmk|matmul|dot_kernel|xmma|cutlass|nvjet|wgmma|hmma)", re.IGNORECASE)
_CUDA_CORE = re.compile(
    r"(ffma|simt|sgemm|dgemm|gemv|gemmsn|gemmk1|dot_kernel|xmma_gemm_f32f32_f32f32|f32f32_f32f32_f32)",
    re.IGNORECASE,
)
_TENSOR_CORE = re.compile(
    r"(tf32|bf16|f16|fp16|half|hmma|wgmma|gmma|tensorop|tensor\d+x\d+x\d+|h884|h1688|h16816|s1688|s16816|"
    r"i8816|i16832|nvjet|e4m3|e5m2)",
    re.IGNORECASE,
)
_EXPLICIT_TC = re.compile(_TENSOR_CORE.pattern.replace("nvjet|", ""), re.IGNORECASE)
_NOT_A_PRODUCT = re.compile(
    r"(splitkreduce|reduce_kernel|elementwise|softmax|layer_?norm|dropout)", re.IGNORECASE
)


def cuda_kernel_kind(name: str) -> str | None:
    """``attention`` (fused SDPA kernels), ``gemm`` (matrix products) or None (anything else)."""
    if _ATTENTION.search(name) and not _NOT_A_PRODUCT.search(name):
        return "attention"
    if _CUDA_GEMM.search(name) and not _NOT_A_PRODUCT.search(name):
        return "gemm"
    return None


_SKINNY = re.compile(r"(gemv|gemmsn|gemmk1|dot_kernel)", re.IGNORECASE)
"""cuBLAS's kernels for skinny products (the NSP head 768->2, the pooler's backward): CUDA cores by
design in every precision, so they are reported on their own line, not held against a mode."""
_OPAQUE = re.compile(r"nvjet", re.IGNORECASE)
"""cuBLASLt kernels whose names do not state their math (``nvjet_tst_...``)."""


def classify_cuda_kernel(name: str) -> str | None:
    """``tensor-core``, ``simt`` (CUDA cores), ``skinny`` (gemv / gemmSN), ``unknown`` (a product
    kernel whose name says neither), or None when the kernel is not a matrix product or attention.

    Strict-fp32 kernels (``..._ffma_...``, ``cutlass_80_simt_sgemm``, ``ampere_sgemm``, the
    ``f32f32_f32f32`` type tuple) are CUDA-core kernels although their names contain ``xmma`` /
    ``cutlass``. Memory-efficient attention in fp32 (``fmha_cutlassF_f32...``) runs its products as
    3xTF32 on tensor cores (fp32-accurate), so it is ``tensor-core`` in every precision; flash and
    cuDNN attention exist only for 16-bit types. ``nvjet`` names say nothing of their math: they
    count as tensor-core here, and :func:`cuda_kernel_verdict` decides them from the precision
    flags of a strict-fp32 run.
    """
    kind = cuda_kernel_kind(name)
    if kind is None:
        return None
    if kind == "attention":
        return "tensor-core"
    if _SKINNY.search(name):
        return "skinny"
    if _CUDA_CORE.search(name):
        return "simt"
    if _TENSOR_CORE.search(name):
        return "tensor-core"
    return "unknown"


def strict_fp32_flags(flags: dict[str, Any] | None) -> bool:
    """Whether the matmul flags in force leave fp32 products no tensor-core path (TF32 off)."""
    if not flags:
        return False
    return not flags.get("cuda_matmul_allow_tf32") and flags.get("float32_matmul_precision") == "highest"


def _by_flags(precision: str, rows: Sequence[dict], flags: dict[str, Any] | None) -> list[dict]:
    """Rows with opaque product kernels decided from the flags: in strict fp32 with TF32 off an fp32
    GEMM has no tensor-core path, whatever cuBLASLt calls its kernel."""
    if precision != "fp32" or not strict_fp32_flags(flags):
        return list(rows)
    out = []
    for r in rows:
        name = r["kernel"]
        opaque = r.get("class") == "unknown" or (
            r.get("class") == "tensor-core" and _OPAQUE.search(name) and not _EXPLICIT_TC.search(name)
        )
        if r.get("kind", cuda_kernel_kind(name)) == "gemm" and opaque:
            r = {**r, "class": "simt", "by_flags": True}
        out.append(r)
    return out


def summarize_cuda_kernels(cuda_kernels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Launch counts and device time per kind (``gemm`` vs ``attention``) and class."""
    out: dict[str, Any] = {}
    for kind in ("gemm", "attention"):
        rows = [k for k in cuda_kernels if k.get("kind", cuda_kernel_kind(k["kernel"])) == kind]
        classes = ("tensor-core", "simt", "skinny", "unknown")
        counts: dict[str, Any] = {c: sum(k["count"] for k in rows if k["class"] == c) for c in classes}
        counts["total"] = sum(k["count"] for k in rows)
        counts["device_us"] = sum(k.get("device_us", 0.0) for k in rows)
        counts["device_us_by_class"] = {
            c: sum(k.get("device_us", 0.0) for k in rows if k["class"] == c) for c in classes
        }
        out[kind] = counts
    return out


TENSOR_CORE_SHARE_MIN = 0.95
"""tf32 / bf16 / fp16: the share of GEMM device time (skinny GEMMs aside) wanted on tensor cores."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def cuda_kernel_verdict(
    precision: str, cuda_kernels: Sequence[dict], flags: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Did the GEMMs of a CUDA run take the path the mode is for? ``ok`` plus one line per kind.

    Weighted by device time (launch counts where the profile has no times): strict fp32 wants no
    GEMM time on tensor cores; tf32 / bf16 / fp16 want at least ``TENSOR_CORE_SHARE_MIN`` of it there.
    Skinny GEMMs (gemv / gemmSN) have their own line and do not decide ``ok``; opaque kernel names
    in strict fp32 are decided from ``flags`` (the precision flags in force, as the plan records
    them). Fused attention has its own line too: memory-efficient attention computes fp32 inputs
    with 3xTF32 tensor-core products (accurate to fp32), expected in every mode.
    """
    rows = _by_flags(precision, cuda_kernels, flags)
    counts = summarize_cuda_kernels(rows)
    a = counts["attention"]
    gemm_rows = [r for r in rows if r.get("kind", cuda_kernel_kind(r["kernel"])) == "gemm"]
    main = [r for r in gemm_rows if r["class"] != "skinny"]
    timed = sum(r.get("device_us", 0.0) for r in gemm_rows) > 0
    weight = (lambda r: r.get("device_us", 0.0)) if timed else (lambda r: float(r["count"]))
    total = sum(weight(r) for r in main)
    share = {
        c: (sum(weight(r) for r in main if r["class"] == c) / total if total else 0.0)
        for c in ("tensor-core", "simt", "unknown")
    }
    basis = "GEMM device time" if timed else "GEMM launches (no device times)"
    flagged = sum(r["count"] for r in main if r.get("by_flags"))
    note = (
        f"; {flagged} opaque launches (nvjet) counted as fp32 from the flags in force (TF32 off)"
        if flagged
        else ""
    )
    if not main:
        gemm_line, ok = "no GEMM kernels recognised in the profile", None
    elif precision == "fp32":
        ok = share["tensor-core"] == 0.0
        gemm_line = (
            f"GEMMs: {_pct(share['tensor-core'])} of {basis} on tensor cores, {_pct(share['simt'])} on CUDA "
            f"cores ({sum(r['count'] for r in main)} launches; strict fp32 expects none on tensor cores: "
            f"{'ok' if ok else 'NOT strict'}{note})"
        )
    else:
        ok = share["tensor-core"] >= TENSOR_CORE_SHARE_MIN
        gemm_line = (
            f"GEMMs: {_pct(share['tensor-core'])} of {basis} on tensor cores, {_pct(share['simt'])} on CUDA cores"
            f"{', ' + _pct(share['unknown']) + ' unrecognised' if share['unknown'] else ''} "
            f"({sum(r['count'] for r in main)} launches; {precision} expects >= {_pct(TENSOR_CORE_SHARE_MIN)}: "
            f"{'ok' if ok else 'NOT on tensor cores'})"
        )
    skinny = [r for r in gemm_rows if r["class"] == "skinny"]
    all_w = sum(weight(r) for r in gemm_rows)
    skinny_line = (
        f"skinny GEMMs (gemv/gemmSN: NSP head, pooler backward; CUDA cores by design): "
        f"{sum(r['count'] for r in skinny)} launches, {_pct(sum(weight(r) for r in skinny) / all_w)} of "
        f"{basis}, not part of the verdict"
        if skinny and all_w
        else None
    )
    attn_line = (
        f"attention: {a['total']} fused-attention launches ({a['tensor-core']} tensor-core by name)"
        if a["total"]
        else "attention: no fused attention kernel (eager/bmm path or masked fallback)"
    )
    text = "; ".join(x for x in (gemm_line, skinny_line, attn_line) if x)
    return {
        "ok": ok,
        "gemm": gemm_line,
        "skinny": skinny_line,
        "attention": attn_line,
        "shares": share,
        "weighted_by": "device_us" if timed else "count",
        "flags": flags,
        "counts": counts,
        "text": text,
    }
