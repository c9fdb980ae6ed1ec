"""summary.json and summary.md from the phase files (pure: tested on CPU with recorded phase files)."""

from __future__ import annotations

import time
from typing import Any

from gpu import settings


def fmt(x: Any, pct: bool = False, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if pct:
        return f"{100 * x:.1f}%"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def ladder_rows(bench: dict[str, Any] | None, fp32_reference: float | None = None) -> list[dict[str, Any]]:
    """One row per run of a bench_train report, with speed-up against bert_mp strict fp32 (of this
    report, else ``fp32_reference``: the uncompiled ladder's fp32 on the same machine)."""
    if not bench:
        return []
    res = bench.get("results", {})
    fp32 = (res.get("bert_mp_fp32") or {}).get("tokens_per_sec") or fp32_reference
    rows = []
    for name, r in res.items():
        tps = r.get("tokens_per_sec")
        rows.append(
            {
                "run": name,
                "tokens_per_sec": tps,
                "step_ms": r.get("step_ms"),
                "mfu": r.get("mfu"),
                "gemm_share": r.get("gemm_share"),
                "positions_per_sec": r.get("positions_per_sec"),
                "speedup_vs_bert_mp_fp32": tps / fp32 if tps and fp32 else None,
                "ratio_vs_hf_fp32": r.get("ratio_vs_baseline"),
                "peak_memory_bytes": r.get("peak_memory_bytes"),
                "peak_reserved_bytes": r.get("peak_reserved_bytes"),
                "skipped": r.get("skipped"),
            }
        )
    return rows


def check_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ladder's targets, each ``{"value", "target", "met"}`` (met None where not measured)."""
    by = {r["run"]: r for r in rows}

    def get(run: str, key: str) -> float | None:
        return (by.get(run) or {}).get(key)

    bf16_mfu = get("bert_mp_bf16", "mfu")
    tf32_x = get("bert_mp_tf32", "speedup_vs_bert_mp_fp32")
    bf16_x = get("bert_mp_bf16", "speedup_vs_bert_mp_fp32")
    fp16_tps, bf16_tps = get("bert_mp_fp16", "tokens_per_sec"), get("bert_mp_bf16", "tokens_per_sec")
    gap = abs(fp16_tps / bf16_tps - 1.0) if fp16_tps and bf16_tps else None

    def t(value: float | None, target: float, higher: bool = True) -> dict[str, Any]:
        met = None if value is None else (value >= target if higher else value <= target)
        return {"value": value, "target": target, "met": met}

    return {
        "bf16_mfu": t(bf16_mfu, settings.TARGETS["bf16_mfu_min"]),
        "tf32_speedup_vs_fp32": t(tf32_x, settings.TARGETS["tf32_speedup_min"]),
        "bf16_speedup_vs_fp32": t(bf16_x, settings.TARGETS["bf16_speedup_min"]),
        "fp16_vs_bf16_gap": t(gap, settings.TARGETS["fp16_vs_bf16_max_gap"], higher=False),
    }


def build_summary(
    phases: dict[str, dict[str, Any] | None], cache: dict[str, Any] | None = None
) -> dict[str, Any]:
    """summary.json from the phase files (any may be missing: then it says ``not run``); ``cache``:
    inductor's cache carried in and packed out (gpu/cache.py)."""
    install = phases.get("install") or {}
    ladder = phases.get("ladder") or {}
    compiled = phases.get("compile") or {}
    rows = ladder_rows(ladder.get("bench"))
    fp32_tps = next((r["tokens_per_sec"] for r in rows if r["run"] == "bert_mp_fp32"), None)
    crow = ladder_rows(compiled.get("bench"), fp32_reference=fp32_tps)
    return {
        "schema": "bert_mp.gpu_check/1",
        "dry_run": any((p or {}).get("dry_run") for p in phases.values()),
        "device": install.get("device") or ladder.get("device"),
        "versions": install.get("versions"),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "phases": {name: (p or {}).get("status", "not run") for name, p in phases.items()},
        "tests": (phases.get("tests") or {}).get("counts"),
        "failed_tests": (phases.get("tests") or {}).get("failed"),
        "ladder": rows,
        "ladder_compiled": crow,
        "paths": paths_rows((phases.get("paths") or {}).get("bench")),
        "targets": check_targets(rows),
        "targets_compiled": check_targets(crow) if crow else None,
        "kernel_check": (phases.get("kernels") or {}).get("kernels") or ladder.get("kernels"),
        "profile": profile_rows((phases.get("profile") or {}).get("profile")),
        "levers": levers_rows((phases.get("levers") or {}).get("levers")),
        "levers_profile": ((phases.get("levers") or {}).get("levers") or {})
        .get("profile", {})
        .get("share_of_step"),
        "attention": _attention_fastest(((phases.get("levers") or {}).get("levers") or {}).get("attention")),
        "large": _large_summary((phases.get("large") or {}).get("large")),
        "sweep": (phases.get("sweep") or {}).get("verdicts"),
        "sweep_runs": (phases.get("sweep") or {}).get("runs"),
        "inductor_cache": cache or None,
        "gemm_rate": gemm_rates(phases),
    }


def gemm_rates(phases: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Per phase, the bf16 GEMM rate its benchmark measured on this machine (the rows' second ceiling)."""
    reports = {
        name: (p or {}).get("bench") or ((p or {}).get(name) if name in ("levers", "large") else p)
        for name, p in phases.items()
    }
    return {name: r["gemm_rate"] for name, r in reports.items() if isinstance(r, dict) and r.get("gemm_rate")}


def _attention_fastest(att: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per dropout: each kernel's forward + backward ms (or why it does not run) and the fastest."""
    if not att:
        return None
    out = {}
    for key, res in att.items():
        if key.startswith("dropout_"):
            out[key] = {
                k: (v.get("fwd_bwd_ms") if isinstance(v, dict) and "fwd_bwd_ms" in v else v)
                for k, v in res.items()
                if k != "fastest" and isinstance(v, dict)
            }
            out[key]["fastest"] = res.get("fastest")
    return out


def _large_summary(large: dict[str, Any] | None) -> dict[str, Any] | None:
    sec = (large or {}).get("large")
    if not sec:
        return None
    verdict = ((sec.get("parity") or {}).get("verdict") or {}).get("status")
    speed = {
        p: {
            k: r.get(k)
            for k in ("tokens_per_sec", "positions_per_sec", "mfu", "gemm_share", "step_ms", "error")
        }
        for p, r in (sec.get("speed") or {}).items()
    }
    return {
        "setup": sec.get("setup"),
        "speed": speed,
        "fp8_speedup": sec.get("fp8_speedup"),
        "fp8_parity": verdict,
    }


def summary_markdown(s: dict[str, Any]) -> str:
    """The human half of the summary: device, phase status, tests, ladder table, targets, kernels."""
    lines = [
        "# bert_mp GPU check" + (" (dry run: tiny model, NOT a GPU measurement)" if s.get("dry_run") else ""),
        "",
        f"Device: {s.get('device') or 'n/a'}. Date (UTC): {s['date_utc']}.",
        "Versions: " + (", ".join(f"{k} {v}" for k, v in (s.get("versions") or {}).items()) or "n/a") + ".",
        "",
        "Phases: " + ", ".join(f"{k}: {v}" for k, v in s["phases"].items()) + ".",
    ]
    for name, g in (s.get("gemm_rate") or {}).items():
        lines.append(
            f"Measured bf16 GEMM rate ({name}; {g['n']}^3 products on random data, median of {g['reps']}): "
            f"{g['flops_per_sec'] / 1e12:,.1f} TFLOP/s: the 'of GEMM rate' columns divide by it, MFU by the "
            "datasheet peak."
        )
    if s.get("inductor_cache"):
        lines.append(f"Inductor cache: {s['inductor_cache']}.")
    if s.get("tests"):
        c = s["tests"]
        lines += [
            "",
            f"CUDA tests: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('errors', 0)} errors, "
            f"{c.get('skipped', 0)} skipped (full text of failures: gpu_check.log).",
        ]
        for f in s.get("failed_tests") or []:
            lines.append(f"- FAILED {f}")
    for title, rows, targets in (
        (
            "Precision ladder" + (" (tiny model)" if s.get("dry_run") else " (BERT-base, seq 128)"),
            s["ladder"],
            s["targets"],
        ),
        (
            "Precision ladder with train.compile=model",
            s.get("ladder_compiled") or [],
            s.get("targets_compiled"),
        ),
    ):
        if not rows:
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "| run | tokens/s | positions/s | step ms | MFU | of GEMM rate | x bert_mp fp32 | x HF fp32 "
            "| peak alloc GiB | peak reserved GiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            if r.get("skipped"):
                lines.append(f"| {r['run']} | skipped: {r['skipped']} | | | | | | | | |")
                continue
            gib = lambda b: fmt(b / 2**30) if b else "n/a"  # noqa: E731
            lines.append(
                f"| {r['run']} | {fmt(r['tokens_per_sec'], digits=0)} | {fmt(r.get('positions_per_sec'), digits=0)} | "
                f"{fmt(r['step_ms'], digits=1)} | {fmt(r['mfu'], pct=True)} | {fmt(r.get('gemm_share'), pct=True)} | "
                f"{fmt(r['speedup_vs_bert_mp_fp32'])} | {fmt(r['ratio_vs_hf_fp32'])} | "
                f"{gib(r.get('peak_memory_bytes'))} | {gib(r.get('peak_reserved_bytes'))} |"
            )
        if targets:
            lines += ["", "| target | value | wanted | met |", "| --- | ---: | ---: | --- |"]
            for name, t in targets.items():
                pct = name in ("bf16_mfu", "fp16_vs_bf16_gap")
                wanted = ("<= " if name == "fp16_vs_bf16_gap" else ">= ") + fmt(t["target"], pct=pct)
                met = {True: "yes", False: "NO", None: "not measured"}[t["met"]]
                lines.append(f"| {name} | {fmt(t['value'], pct=pct)} | {wanted} | {met} |")
    if s.get("paths"):
        lines += [
            "",
            f"## Encoder paths ({s['paths'][0].get('precision')}, attention dropout 0; tokens/s count real tokens)",
            "",
            "| corpus | run | tokens/s | positions/s | step ms | MFU | of GEMM rate | x padded | x HF fp32 | graphs |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in s["paths"]:
            lines.append(
                f"| {r['corpus']} | {r['run']} | {fmt(r['tokens_per_sec'], digits=0)} | "
                f"{fmt(r.get('positions_per_sec'), digits=0)} | {fmt(r['step_ms'], digits=1)} | "
                f"{fmt(r['mfu'], pct=True)} | {fmt(r.get('gemm_share'), pct=True)} | {fmt(r['ratio_vs_padded'])} | "
                f"{fmt(r['ratio_vs_hf_fp32'])} | {fmt(r['compiled_graphs'])} |"
            )
    if s.get("kernel_check"):
        lines += ["", "## Kernel check (weighted by device time)", ""]
        for prec, k in s["kernel_check"].items():
            check = k.get("check") if isinstance(k, dict) else None
            if check and check.get("gemm"):
                lines += [f"- {prec}: {check['gemm']}"]
                lines += [f"  - {check[key]}" for key in ("skinny", "attention") if check.get(key)]
            elif isinstance(k, dict) and "verdict" in k:
                lines.append(f"- {prec}: {k['verdict']}")
            else:
                lines.append(f"- {prec}: {k}")
    if s.get("profile"):
        lines += ["", "## Where the step's time goes (timed steps only; shares of kernel time)", ""]
        for r in s["profile"]:
            top = ", ".join(f"{k} {fmt(v, pct=True)}" for k, v in list(r["shares"].items())[:6])
            lines.append(
                f"- {r['path']}: {fmt(r['tokens_per_sec'], digits=0)} tokens/s under the profiler, "
                f"{fmt(r['kernel_ms_per_step'], digits=1)} ms of kernels a step "
                f"({fmt(r.get('busy_fraction'), pct=True)} of the step): {top or 'no kernels recorded'}"
            )
    if s.get("levers"):
        lines += [
            "",
            "## Lever ladder (bf16; tokens/s and MFU as bert-mp train logs them; extra rows on the best row)",
            "",
            "| lever | tokens/s | positions/s | step ms | MFU | of GEMM rate | x previous / best | attention "
            "| graphs | graph breaks | cudagraph skips |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for r in s["levers"]:
            if r.get("error"):
                lines.append(f"| {r['lever']} | failed: {r['error'][:120]} | | | | | | | | | |")
                continue
            lines.append(
                f"| {r['lever']}{' (recipe)' if r.get('recipe_change') else ''} | {fmt(r['tokens_per_sec'], digits=0)} | "
                f"{fmt(r.get('positions_per_sec'), digits=0)} | {fmt(r['step_ms'], digits=1)} | "
                f"{fmt(r['mfu'], pct=True)} | {fmt(r.get('gemm_share'), pct=True)} | "
                f"{fmt(r.get('x_previous') or r.get('x_best'))} | {(r.get('token_budget') or {}).get('attention', '')} | "
                f"{fmt(r['compiled_graphs'])} | {fmt(r['graph_breaks'])} | {fmt(r['cudagraph_skips'])} |"
            )
        if s.get("levers_profile"):
            shares = ", ".join(f"{k} {fmt(v, pct=True)}" for k, v in s["levers_profile"].items())
            lines += ["", f"Best row's step by kernel class: {shares}."]
        for key, res in (s.get("attention") or {}).items():
            lines.append(f"- attention {key}: fastest {res.get('fastest')}: {res}")
    if s.get("large"):
        lines += ["", f"## BERT-large packed: {s['large']}"]
    if s.get("sweep_runs"):
        lines += [
            "",
            "## Sweep runs",
            "",
            "| run | status | steps | tokens/s | positions/s | MFU | of GEMM rate | eval MLM loss |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, r in s["sweep_runs"].items():
            lines.append(
                f"| {name} | {r.get('status')} | {fmt(r.get('steps'))} | {fmt(r.get('tokens_per_sec'), digits=0)} | "
                f"{fmt(r.get('positions_per_sec'), digits=0)} | {fmt(r.get('mfu'), pct=True)} | "
                f"{fmt(r.get('gemm_share'), pct=True)} | {fmt(r.get('eval_mlm_loss'), digits=3)} |"
            )
    if s.get("sweep"):
        lines += ["", "## Sweep parity verdicts", ""]
        for name, v in s["sweep"].items():
            lines.append(f"- {name}: {v}")
    return "\n".join(lines) + "\n"


def levers_rows(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ladder's rows, then the extra rows, as the summary shows them."""
    rows = []
    for r in [*((report or {}).get("ladder") or []), *((report or {}).get("extra") or [])]:
        rows.append(
            {
                k: r.get(k)
                for k in (
                    "lever",
                    "tokens_per_sec",
                    "step_ms",
                    "mfu",
                    "gemm_share",
                    "positions_per_sec",
                    "token_budget",
                    "x_previous",
                    "x_best",
                    "peak_memory_bytes",
                    "compiled_graphs",
                    "graph_breaks",
                    "cudagraph_skips",
                    "recipe_change",
                    "error",
                )
            }
        )
    return rows


def paths_rows(bench: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per corpus and path of a ``bench_train.py --paths`` report (finished or partial)."""
    rows = []
    for corpus, c in ((bench or {}).get("corpora") or {}).items():
        rounds = c.get("rounds") or ([c["partial_round"]] if c.get("partial_round") else [])
        for name, r in (rounds[0] if rounds else {}).items():
            if not isinstance(r, dict):
                continue
            rows.append(
                {
                    "corpus": corpus,
                    "run": name,
                    "tokens_per_sec": r.get("tokens_per_sec"),
                    "step_ms": r.get("step_ms"),
                    "mfu": r.get("mfu"),
                    "gemm_share": r.get("gemm_share"),
                    "positions_per_sec": r.get("positions_per_sec"),
                    "ratio_vs_padded": r.get("ratio_vs_padded"),
                    "ratio_vs_hf_fp32": r.get("ratio_vs_baseline"),
                    "compiled_graphs": r.get("compiled_graphs"),
                    "padding_fraction": c.get("padding_fraction_at_max_seq_length"),
                    "precision": ((bench or {}).get("setup") or {}).get("precision"),
                }
            )
    return rows


def profile_rows(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per profiled path: tokens/s, kernel time per step, the groups' shares (largest first)."""
    rows = []
    for path, r in ((report or {}).get("paths") or {}).items():
        groups = r.get("groups") or {}
        rows.append(
            {
                "path": path,
                "tokens_per_sec": (r.get("bench") or {}).get("tokens_per_sec"),
                "kernel_ms_per_step": r.get("device_ms_per_step"),
                "busy_fraction": r.get("busy_fraction"),
                "time": r.get("time"),
                "shares": {k: v.get("share") for k, v in groups.items()},
            }
        )
    return rows
