"""Validate bert_mp on a bare GPU machine: phases that each fit a lent machine's command.

    python scripts/gpu_check.py OUT_DIR [PHASE ...] [--dry-run] [--force] [--budget PHASE=S]
    python scripts/gpu_check.py OUT_DIR --rehearse      # the docs/gpu.md sequence on this CPU

A lent GPU machine is fresh for almost every command (it goes back after 30 s idle), has no
package index and runs a command for at most 10 minutes. So:

- every command installs what it needs first when ``.gpu_site/`` has no record of an install
  (``install``: the carried wheels from ``scripts/gpu_wheels.sh`` that the machine lacks, with
  ``pip install --no-index --no-deps --target .gpu_site``; the machine's own torch is used);
- every phase has an explicit budget (``BUDGETS``; pytest runs with a per-test timeout) and the
  command a deadline (``--deadline``); a phase cut at its budget keeps what it finished;
- results are written while they are measured: each ladder row, each compiled row, each kernel
  verdict, each sweep run lands in OUT_DIR (phase JSONs, ``summary.json`` / ``summary.md`` and
  ``gpu_check.log`` with the full text of any failing test; at most 8 files);
- ``COMMANDS`` is the sequence docs/gpu.md gives; ``--rehearse`` runs it on a CPU with tiny
  shapes, each command on a fresh copy of the repository (CI: test_gpu_check_rehearsal.py).

Phases: ``install``, ``ladder`` (bench_train.py on BERT-base seq 128: HF strict fp32 / bf16 and
bert_mp fp32 / bf16 / tf32 / fp16 / bf16_pure), ``paths`` (bf16 padded vs unpadded vs unpadded + compiled on the
built-in and the short-documents corpus, attention dropout 0 so the unpadded path may take torch's varlen
flash kernel), ``tests`` (the CUDA tests), ``kernels`` (the kernel probe per
precision: GEMM verdicts weighted by device time, skinny GEMMs on their own line), ``profile``
(scripts/profile_step.py: bf16 padded / unpadded / unpadded + compiled, each kernel's device time
over the timed steps, grouped: GEMM, attention, LayerNorm, copies ...), ``compile``
(the ladder with ``train.compile=model``), ``sweep`` (configs/sweep_gpu_short.yaml: BERT-base,
200 steps per precision plus the second fp32 seed, parity verdicts, on a docstring corpus built
in seconds; ``--long-sweep`` for configs/sweep_gpu_base.yaml), ``summary``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / "runs" / "gpu_check"
SITE = ROOT / ".gpu_site"
INSTALLED = "INSTALLED.json"
"""Written into SITE by a successful install: a command that finds it skips the install."""
WHEELS = ROOT / ".wheels"
PHASES = (
    "install",
    "levers",
    "large",
    "ladder",
    "paths",
    "tests",
    "kernels",
    "profile",
    "compile",
    "sweep",
    "summary",
)
DEFAULT_PHASES = ("ladder", "tests")
COMMANDS = (
    ("large",),
    ("sweep",),
    ("levers",),
    ("tests", "kernels", "profile"),
    ("compile",),
    ("ladder", "paths"),
)
"""The sequence docs/gpu.md gives: one command each, each on a fresh machine (install is implied)."""
BUDGETS = {
    "install": 60.0,
    "levers": 420.0,
    "large": 420.0,
    "ladder": 240.0,
    "paths": 300.0,
    "tests": 180.0,
    "kernels": 90.0,
    "profile": 200.0,
    "compile": 300.0,
    "sweep": 420.0,
}
"""Seconds per phase on a GPU machine (each command stays under ``DEADLINE_S``)."""
BUDGETS_DRY = {
    "install": 60.0,
    "levers": 150.0,
    "large": 150.0,
    "ladder": 120.0,
    "paths": 120.0,
    "tests": 120.0,
    "kernels": 60.0,
    "profile": 90.0,
    "compile": 120.0,
    "sweep": 150.0,
}
DEADLINE_S = 450.0
"""One command's wall time: 7.5 minutes, under the 10-minute limit with the machine's start."""
RESERVE_S, MIN_PHASE_S, TICK_S = 15.0, 30.0, 5.0
MAX_OUT_FILES = 8
LOG_NAME, LOG_CAP = "gpu_check.log", 200_000
GPU_TESTS = (
    "tests/unit/pretrain/test_gpu.py",
    "tests/integration/test_gpu_resume.py",
    "tests/unit/core/test_cuda_paths.py",
    "tests/unit/pretrain/test_sync_budget.py",
)
TESTS_K_ENV = "BERT_MP_GPU_CHECK_TESTS_K"
"""If set, a ``pytest -k`` expression for the ``tests`` phase: the CPU rehearsal runs the phase's
plumbing on a few of GPU_TESTS' CPU tests (the suite itself runs all of them)."""
CARRIED = (
    "datasets",
    "dill",
    "multiprocess",
    "xxhash",
    "fsspec",
    "omegaconf",
    "pytest",
    "pluggy",
    "iniconfig",
    "pygments",
    "pytorch-optimizer",
    "torch-optimi",
    "torchao",
)
WANTED = ("datasets", "omegaconf", "pytest", "pytorch-optimizer", "torch-optimi", "torchao")
TARGETS = {
    "bf16_mfu_min": 0.45,
    "tf32_speedup_min": 3.0,
    "bf16_speedup_min": 5.0,
    "fp16_vs_bf16_max_gap": 0.05,
}
"""The precision ladder's targets on an H100 (BERT-base, seq 128): speed-ups against strict fp32."""


# --------------------------------------------------------------------------------------------------
# wheel choice (pure: tested on CPU with fake wheels)
# --------------------------------------------------------------------------------------------------
def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_info(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, unconditional Requires-Dist) read from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode("utf-8"))
    reqs = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return _canon(meta["Name"]), meta["Version"], reqs


def choose_wheels(
    wheels: list[Path], installed: dict[str, str], wanted: tuple[str, ...] = ("datasets", "omegaconf")
) -> tuple[dict[str, Path], list[str]]:
    """Pick carried wheels so that ``wanted`` and their requirements are met.

    ``installed`` maps canonical names to the machine's versions; those are used where they satisfy a
    requirement (a carried wheel never replaces a working installed package). Candidates of a wanted
    package are tried newest first. Returns ``(chosen name -> wheel, problems)``; ``problems`` lists
    requirements nothing satisfies (empty when the choice is complete).
    """
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = default_environment()
    by_name: dict[str, list[tuple[Version, Path, list[str]]]] = {}
    for w in wheels:
        name, version, reqs = wheel_info(w)
        by_name.setdefault(name, []).append((Version(version), w, reqs))
    for cands in by_name.values():
        cands.sort(key=lambda c: c[0], reverse=True)

    def resolve(req: Requirement, chosen: dict[str, tuple[Version, Path, list[str]]], depth: int) -> bool:
        name = _canon(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            return True
        if name in chosen:
            return req.specifier.contains(chosen[name][0], prereleases=True)
        if name in installed and req.specifier.contains(installed[name], prereleases=True):
            return True
        if depth > 4:
            return False
        for cand in by_name.get(name, []):
            if not req.specifier.contains(cand[0], prereleases=True):
                continue
            trial = {**chosen, name: cand}
            if all(resolve(Requirement(r), trial, depth + 1) for r in cand[2]):
                chosen.update(trial)
                return True
        return False

    chosen: dict[str, tuple[Version, Path, list[str]]] = {}
    problems = []
    for name in wanted:
        if name in installed:
            continue
        if not resolve(Requirement(name), chosen, 0):
            cands = by_name.get(name, [])
            unmet = []
            for _, _, reqs in cands[:1]:
                for r in reqs:
                    if not resolve(Requirement(r), dict(chosen), 1):
                        unmet.append(r)
            problems.append(
                f"{name}: no carried version fits this machine (unmet: {', '.join(unmet) or 'no wheel'})"
            )
    return {n: c[1] for n, c in chosen.items()}, problems


def installed_versions(python: str) -> dict[str, str]:
    """Canonical name -> version of every distribution ``python`` sees (its own site-packages)."""
    code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, env=_clean_env())
    return {_canon(k): v for k, v in json.loads(out.stdout).items()}


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


# --------------------------------------------------------------------------------------------------
# summary (pure: tested on CPU with recorded phase files)
# --------------------------------------------------------------------------------------------------
def _fmt(x: Any, pct: bool = False, digits: int = 2) -> str:
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
        "bf16_mfu": t(bf16_mfu, TARGETS["bf16_mfu_min"]),
        "tf32_speedup_vs_fp32": t(tf32_x, TARGETS["tf32_speedup_min"]),
        "bf16_speedup_vs_fp32": t(bf16_x, TARGETS["bf16_speedup_min"]),
        "fp16_vs_bf16_gap": t(gap, TARGETS["fp16_vs_bf16_max_gap"], higher=False),
    }


def build_summary(phases: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """summary.json from the phase files (any may be missing: then it says ``not run``)."""
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
    }


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
        p: {k: r.get(k) for k in ("tokens_per_sec", "mfu", "step_ms", "error")}
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
            "| run | tokens/s | step ms | MFU | x bert_mp fp32 | x HF fp32 | peak alloc GiB | peak reserved GiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            if r.get("skipped"):
                lines.append(f"| {r['run']} | skipped: {r['skipped']} | | | | | | |")
                continue
            gib = lambda b: _fmt(b / 2**30) if b else "n/a"  # noqa: E731
            lines.append(
                f"| {r['run']} | {_fmt(r['tokens_per_sec'], digits=0)} | {_fmt(r['step_ms'], digits=1)} | "
                f"{_fmt(r['mfu'], pct=True)} | {_fmt(r['speedup_vs_bert_mp_fp32'])} | {_fmt(r['ratio_vs_hf_fp32'])} | "
                f"{gib(r.get('peak_memory_bytes'))} | {gib(r.get('peak_reserved_bytes'))} |"
            )
        if targets:
            lines += ["", "| target | value | wanted | met |", "| --- | ---: | ---: | --- |"]
            for name, t in targets.items():
                pct = name in ("bf16_mfu", "fp16_vs_bf16_gap")
                wanted = ("<= " if name == "fp16_vs_bf16_gap" else ">= ") + _fmt(t["target"], pct=pct)
                met = {True: "yes", False: "NO", None: "not measured"}[t["met"]]
                lines.append(f"| {name} | {_fmt(t['value'], pct=pct)} | {wanted} | {met} |")
    if s.get("paths"):
        lines += [
            "",
            f"## Encoder paths ({s['paths'][0].get('precision')}, attention dropout 0; tokens/s count real tokens)",
            "",
            "| corpus | run | tokens/s | step ms | MFU | x padded | x HF fp32 | graphs |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in s["paths"]:
            lines.append(
                f"| {r['corpus']} | {r['run']} | {_fmt(r['tokens_per_sec'], digits=0)} | {_fmt(r['step_ms'], digits=1)} | "
                f"{_fmt(r['mfu'], pct=True)} | {_fmt(r['ratio_vs_padded'])} | {_fmt(r['ratio_vs_hf_fp32'])} | "
                f"{_fmt(r['compiled_graphs'])} |"
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
            top = ", ".join(f"{k} {_fmt(v, pct=True)}" for k, v in list(r["shares"].items())[:6])
            lines.append(
                f"- {r['path']}: {_fmt(r['tokens_per_sec'], digits=0)} tokens/s under the profiler, "
                f"{_fmt(r['kernel_ms_per_step'], digits=1)} ms of kernels a step "
                f"({_fmt(r.get('busy_fraction'), pct=True)} of the step): {top or 'no kernels recorded'}"
            )
    if s.get("levers"):
        lines += [
            "",
            "## Lever ladder (bf16; cumulative; tokens/s and MFU as bert-mp train logs them)",
            "",
            "| lever | tokens/s | step ms | MFU | x previous | graphs | graph breaks | cudagraph skips |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in s["levers"]:
            if r.get("error"):
                lines.append(f"| {r['lever']} | failed: {r['error'][:120]} | | | | | | |")
                continue
            lines.append(
                f"| {r['lever']}{' (recipe)' if r.get('recipe_change') else ''} | {_fmt(r['tokens_per_sec'], digits=0)} | "
                f"{_fmt(r['step_ms'], digits=1)} | {_fmt(r['mfu'], pct=True)} | "
                f"{_fmt(r.get('x_previous') or r.get('x_best'))} | {_fmt(r['compiled_graphs'])} | "
                f"{_fmt(r['graph_breaks'])} | {_fmt(r['cudagraph_skips'])} |"
            )
        if s.get("levers_profile"):
            shares = ", ".join(f"{k} {_fmt(v, pct=True)}" for k, v in s["levers_profile"].items())
            lines += ["", f"Best row's step by kernel class: {shares}."]
        for key, res in (s.get("attention") or {}).items():
            lines.append(f"- attention {key}: fastest {res.get('fastest')}: {res}")
    if s.get("large"):
        lines += ["", f"## BERT-large packed: {s['large']}"]
    if s.get("sweep"):
        lines += ["", "## Sweep parity verdicts", ""]
        for name, v in s["sweep"].items():
            lines.append(f"- {name}: {v}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# running children: in their own process group, cut at a deadline, progress published while they run
# --------------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(SITE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    return env


def _run(
    cmd: list[str],
    timeout: float,
    log: Path,
    tick: Any = None,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; on timeout SIGTERM the group (runs save and stop).

    ``tick()`` is called every few seconds while it runs (to publish partial results). Returns the
    exit code (124: cut at the deadline) and the last 4000 characters of its output.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max(1.0, timeout)
    with open(log, "w") as f:
        p = subprocess.Popen(
            cmd, cwd=ROOT, env=env or _env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        rc = None
        while rc is None:
            try:
                rc = p.wait(timeout=max(0.1, min(TICK_S, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if tick is not None:
                    tick()
                if time.monotonic() < deadline:
                    continue
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                rc = 124  # cut at the deadline (the children were asked to save and stop)
    return rc, log.read_text(errors="replace")[-4000:]


def _status(rc: int) -> str:
    return "ok" if rc == 0 else ("timeout" if rc == 124 else "failed")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _device_info() -> dict[str, Any]:
    code = (
        "import json, torch, transformers, accelerate, sys\n"
        "d = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'transformers': transformers.__version__, 'accelerate': accelerate.__version__}\n"
        "import datasets, omegaconf; d['datasets'] = datasets.__version__; d['omegaconf'] = omegaconf.__version__\n"
        "import pytest; d['pytest'] = pytest.__version__\n"
        "import bert_mp.pretrain.trainer\n"
        "dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu (no CUDA)'\n"
        "cap = '.'.join(map(str, torch.cuda.get_device_capability(0))) if torch.cuda.is_available() else None\n"
        "print(json.dumps({'versions': d, 'device': dev, 'capability': cap, 'bert_mp': bert_mp.__file__}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# phases: each returns its result dict and may call args.progress(partial) while it runs
# --------------------------------------------------------------------------------------------------
def phase_install(args: argparse.Namespace) -> dict[str, Any]:
    wheels = sorted(Path(args.wheels).glob("*.whl"))
    installed = installed_versions(sys.executable)
    missing = [n for n in CARRIED if n not in installed]
    chosen, problems = choose_wheels(wheels, installed, WANTED) if wheels else ({}, [])
    res: dict[str, Any] = {"machine_has": {n: installed.get(n) for n in CARRIED}, "missing": missing}
    SITE.mkdir(exist_ok=True)
    if chosen:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index"]
        cmd += ["--no-deps", "--upgrade", "--target", str(SITE), *map(str, chosen.values())]
        out = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
        res["pip"] = {"rc": out.returncode, "tail": (out.stdout + out.stderr)[-2000:]}
    res["carried"] = {n: p.name for n, p in chosen.items()}
    res["problems"] = problems + (
        []
        if wheels or not missing
        else [f"no .wheels/ to install {missing} from: run scripts/gpu_wheels.sh here and carry .wheels"]
    )
    info = _device_info()
    res.update(info)
    res["status"] = "ok" if "error" not in info and not problems else "failed"
    if res["status"] == "ok":  # later phases of this machine find it; a fresh machine has none
        (SITE / INSTALLED).write_text(json.dumps({k: res.get(k) for k in ("device", "versions")}))
    return res


def phase_tests(args: argparse.Namespace) -> dict[str, Any]:
    junit = STATE / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu or not slow"]
    cmd += ["-rfE", "--tb=long", f"--junitxml={junit}", *GPU_TESTS]
    if os.environ.get(TESTS_K_ENV):
        cmd += ["-k", os.environ[TESTS_K_ENV]]
    env = _env()
    env["BERT_MP_TEST_TIMEOUT"] = str(args.test_timeout)  # tests/conftest.py: SIGALRM per test
    rc, tail = _run(cmd, args.budget, STATE / "tests.log", env=env)
    counts, failed, failures = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}, [], {}
    if junit.exists():
        import xml.etree.ElementTree as ET

        for case in ET.parse(junit).getroot().iter("testcase"):
            bad = [c for c in case if c.tag in ("failure", "error")]
            name = f"{case.get('classname')}::{case.get('name')}"
            if bad:
                counts["failed" if bad[0].tag == "failure" else "errors"] += 1
                failed.append(name)
                # the whole text of the failure, not a tail: it goes to gpu_check.log
                failures[name] = (bad[0].get("message") or "") + "\n" + (bad[0].text or "")
            elif any(c.tag == "skipped" for c in case):
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    else:  # cut before pytest wrote its report: the verbose log still names each finished test
        for name, outcome in _VERBOSE_RESULT.findall((STATE / "tests.log").read_text(errors="replace")):
            key = {"PASSED": "passed", "SKIPPED": "skipped", "FAILED": "failed", "ERROR": "errors"}[outcome]
            counts[key] += 1
            if key in ("failed", "errors"):
                failed.append(name)
    return {
        "status": _status(rc),
        "rc": rc,
        "per_test_timeout_s": args.test_timeout,
        "counts": counts,
        "failed": failed,
        "failures": failures,
        "tail": tail[-1500:],
    }


_VERBOSE_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", re.MULTILINE)


def _bench(args: argparse.Namespace, compile_mode: str, name: str) -> dict[str, Any]:
    """bench_train.py for one ladder; its JSON gains each row the moment the row is measured."""
    if args.dry_run:
        size = ["--preset", "tiny", "--vocab", "300", "--seq", "32", "--micro-batch", "8"]
        size += ["--steps", "2", "--warmup", "1"]
    else:
        size = [
            "--preset",
            "base",
            "--vocab",
            "30522",
            "--seq",
            "128",
            "--micro-batch",
            str(args.micro_batch),
        ]
        size += ["--steps", "20", "--warmup", "5"]
    # the reference first: strict fp32 (bert_mp, then HF) and bf16 are the rows a cut must not lose
    precisions = "fp32,bf16,tf32,fp16,bf16_pure" if compile_mode == "none" else "bf16,tf32,fp16"
    if args.dry_run and compile_mode != "none":
        precisions = "tf32"  # the rehearsal checks the plumbing, one row is enough
    baselines = "fp32,bf16" if compile_mode == "none" else "fp32"
    bench_args = [*size, "--repeat", "1", "--precisions", precisions]
    bench_args += ["--baseline-precisions", baselines, "--compile", compile_mode]
    # a CPU rehearsal checks the plumbing; inductor on 2 cores would take minutes
    return _run_bench(args, name, bench_args, no_compile=args.dry_run and compile_mode != "none")


def _run_bench(
    args: argparse.Namespace, name: str, bench_args: list[str], no_compile: bool
) -> dict[str, Any]:
    """``scripts/bench_train.py BENCH_ARGS`` into ``bench_NAME.json``, published while it runs (a cut
    keeps every row finished before it); ``no_compile``: ``TORCH_COMPILE_DISABLE=1`` (CPU rehearsal)."""
    out = STATE / f"bench_{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "scripts/bench_train.py", *bench_args, "--out", str(out)]
    env = _env()
    if no_compile:
        env["TORCH_COMPILE_DISABLE"] = "1"
    rc, tail = _run(
        cmd,
        args.budget,
        STATE / f"bench_{name}.log",
        tick=lambda: args.progress({"bench": _read_json(out)}),
        env=env,
    )
    return {"status": _status(rc), "rc": rc, "bench": _read_json(out), "tail": tail if rc else tail[-800:]}


def phase_ladder(args: argparse.Namespace) -> dict[str, Any]:
    res = _bench(args, "none", "ladder")
    res["device"] = (res.get("bench") or {}).get("device")
    return res


def phase_compile(args: argparse.Namespace) -> dict[str, Any]:
    return _bench(args, "model", "compile")


LEVERS_RUN = ["--levers", "compile,cuda_graphs,bf16_norms", "--attention", "--profile"]
LEVERS_RUN += ["--extra-levers", "no_dropout,unpad"]
"""The lever ladder (cumulative), SDPA's kernels timed, the best row profiled, then each extra lever on
top of the best row (after the profile: a cut loses those first). Measured on an H200 (2026-11-28):
``compile,bf16_norms,cuda_graphs,unpad`` then ``no_dropout,max_autotune`` took more than 460 s
(max-autotune's GEMM autotuning was cut); bf16 norms now come after CUDA graphs, so the graphs are
compared with the plain compiled row and the norms with the graphed one."""


def phase_levers(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench_levers.py: BERT-base seq 128 bf16 on the built-in corpus, eager padded then each
    lever on top; each row written when measured."""
    if args.dry_run:
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "8", "--steps", "2", "--warmup", "1"]
        size += ["--heads", "2", "--attention-reps", "2", "--profile-steps", "2", "--profile-warmup", "1"]
    else:
        size = ["--preset", "base", "--seq", "128", "--micro-batch", str(args.micro_batch)]
        size += ["--steps", "20", "--warmup", "5"]
    return _run_levers(args, "levers", [*size, *LEVERS_RUN])


def phase_large(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench_levers.py --large: BERT-large seq 512 on packed rows, bf16 vs fp8 (torchao float8),
    then 200 steps each of bf16 (two seeds) and fp8, and fp8's parity verdict against bf16."""
    size = ["--no-ladder", "--large", "--steps", "20", "--warmup", "5"]
    if args.dry_run:
        size = ["--no-ladder", "--large", "--steps", "1", "--warmup", "1", "--large-preset", "tiny"]
        size += ["--large-seq", "64", "--large-micro-batch", "4", "--large-steps", "4", "--allow-emulated"]
    return _run_levers(args, "large", size)


def _run_levers(args: argparse.Namespace, name: str, bench_args: list[str]) -> dict[str, Any]:
    out = STATE / f"bench_{name}.json"
    out.unlink(missing_ok=True)
    env = _env()
    if args.dry_run:
        env["TORCH_COMPILE_DISABLE"] = "1"  # the plumbing, not inductor on 2 cores
    rc, tail = _run(
        [sys.executable, "scripts/bench_levers.py", *bench_args, "--out", str(out)],
        args.budget,
        STATE / f"bench_{name}.log",
        tick=lambda: args.progress({name: _read_json(out)}),
        env=env,
    )
    return {"status": _status(rc), "rc": rc, name: _read_json(out), "tail": tail if rc else tail[-800:]}


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


PATHS_RUN = "padded,unpad,unpad+compile"


def phase_paths(args: argparse.Namespace) -> dict[str, Any]:
    """bench_train.py --paths: the encoder paths of model.unpad side by side, each row written when measured."""
    if args.dry_run:
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "8", "--steps", "2", "--warmup", "1"]
        size += ["--precisions", "fp32", "--corpus", "builtin"]
    else:
        size = ["--preset", "base", "--seq", "128", "--micro-batch", str(args.micro_batch)]
        size += ["--steps", "20", "--warmup", "5", "--precisions", "bf16", "--corpus", "builtin,short"]
    bench_args = ["--paths", PATHS_RUN, *size, "--repeat", "1", "--attention-dropout", "0"]
    return _run_bench(args, "paths", bench_args, no_compile=args.dry_run)


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
                    "ratio_vs_padded": r.get("ratio_vs_padded"),
                    "ratio_vs_hf_fp32": r.get("ratio_vs_baseline"),
                    "compiled_graphs": r.get("compiled_graphs"),
                    "padding_fraction": c.get("padding_fraction_at_max_seq_length"),
                    "precision": ((bench or {}).get("setup") or {}).get("precision"),
                }
            )
    return rows


KERNEL_PROBE = """
import json, sys, torch
from transformers import BertForPreTraining
from bert_mp.core.config import ModelConfig
from bert_mp.sweep.diagnostics import probe_precision, synthetic_batch
from bert_mp.errors import HardwareError
from bert_mp.model.bert import PretrainingModel, bert_config
from bert_mp.core.numerics.precision import resolve_precision
out, preset, batch, seq, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
res = {}
for prec in sys.argv[6].split(","):
    try:
        plan = resolve_precision(prec, dev)
    except HardwareError as e:
        res[prec] = "skipped: " + str(e)
        continue
    torch.manual_seed(0)
    model = PretrainingModel(BertForPreTraining(bert_config(ModelConfig(preset=preset), vocab)), max_predictions_per_seq=20).to(dev)
    r = probe_precision(model, synthetic_batch(vocab, batch, seq, dev), plan, steps=2)
    res[prec] = {"verdict": r["kernel_verdict"], "check": r.get("cuda_kernel_check"),
                 "top_kernels": r["cuda_kernels"][:12], "padding_fraction": r["batch_padding_fraction"],
                 "measured_bytes": r["measured_bytes"]}
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    with open(out + ".partial", "w") as f:  # each precision's verdict the moment it is known
        json.dump(res, f, indent=1, default=str)
    import os; os.replace(out + ".partial", out)
"""


def phase_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel probe per precision (GEMM and attention verdicts, top kernels by device time)."""
    out = STATE / "kernels_probe.json"
    out.unlink(missing_ok=True)
    size = (
        ("tiny", "4", "32", "300", "fp32,bf16")
        if args.dry_run
        else ("base", "32", "128", "30528", "fp32,bf16,tf32,fp16")
    )
    rc, tail = _run(
        [sys.executable, "-c", KERNEL_PROBE, str(out), *size],
        args.budget,
        STATE / "kernels.log",
        tick=lambda: args.progress({"kernels": _read_json(out)}),
    )
    return {"status": _status(rc), "rc": rc, "kernels": _read_json(out), "tail": tail[-1500:]}


PROFILE_PATHS = "padded,padded:bf16_pure,padded+compile,padded+compile:bf16_pure,unpad+compile,unpad"
"""The encoder paths in bf16, eager and compiled, and the padded ones in pure bf16 too (no autocast
casts, bf16 residual stream): which of the step's non-GEMM kernels compile and bf16 activations remove."""


def phase_profile(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/profile_step.py: where a bf16 step's device time goes, per encoder path (the timed steps
    only), each path written when profiled."""
    out = STATE / "profile_step.json"
    out.unlink(missing_ok=True)
    if args.dry_run:
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "4", "--steps", "2", "--warmup", "1"]
        size += ["--precision", "fp32", "--allow-emulated"]  # bf16_pure on any CPU, for the plumbing
    else:
        size = ["--preset", "base", "--seq", "128", "--micro-batch", str(args.micro_batch)]
        size += ["--steps", "6", "--warmup", "3", "--precision", "bf16"]
    env = _env()
    if args.dry_run:
        env["TORCH_COMPILE_DISABLE"] = "1"  # the plumbing, not inductor on 2 cores
    rc, tail = _run(
        [sys.executable, "scripts/profile_step.py", *size, "--paths", PROFILE_PATHS, "--out", str(out)],
        args.budget,
        STATE / "profile.log",
        tick=lambda: args.progress({"profile": _read_json(out)}),
        env=env,
    )
    return {"status": _status(rc), "rc": rc, "profile": _read_json(out), "tail": tail[-1500:]}


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


def _extract_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 8:
                parts.append(" ".join(doc.split()))
    return "\n".join(parts) + "\n\n" if parts else ""


def write_docstring_corpus(dest: Path, max_bytes: int, roots: list[Path] | None = None) -> dict[str, Any]:
    """Real English text offline: module/class/function docstrings of installed Python packages.

    One document per module (its docstrings, a blank line between documents), written to
    ``dest/corpus_NN.txt`` until ``max_bytes``. Deterministic (sorted paths, kept in order) and
    parsed on every core: the short sweep's 12 MB take seconds.
    """
    import multiprocessing as mp
    import site

    dest.mkdir(parents=True, exist_ok=True)
    roots = roots or [
        Path(p) for p in {*site.getsitepackages(), *sys.path} if p and Path(p).is_dir() and "packages" in p
    ]
    paths = [path for root in sorted(set(roots)) for path in sorted(root.rglob("*.py"))]
    written, docs, shard, fh = 0, 0, 0, None
    with mp.get_context("fork").Pool(max(1, min(16, os.cpu_count() or 1))) as pool:
        for text in pool.imap(_extract_docstrings, paths, chunksize=16):
            if not text:
                continue
            if fh is None or fh.tell() > 64 * 2**20:
                if fh:
                    fh.close()
                fh = open(dest / f"corpus_{shard:02d}.txt", "w", encoding="utf-8")  # noqa: SIM115 (rotating shards)
                shard += 1
            fh.write(text)
            written += len(text.encode())
            docs += 1
            if written >= max_bytes:
                pool.terminate()
                break
    if fh:
        fh.close()
    return {"bytes": written, "documents": docs, "files": shard}


def sweep_verdicts(report: dict[str, Any]) -> dict[str, str]:
    """``group/run -> "status: first reason"`` plus the sweep's own speed ladder, from its summary.json."""
    out: dict[str, str] = {}
    for g in report.get("groups") or []:
        for run, v in (g.get("verdicts") or {}).items():
            reasons = v.get("reasons") or []
            out[f"{g.get('name')}/{run}"] = v.get("status", "?") + (f": {reasons[0]}" if reasons else "")
        for row in g.get("speed_ladder") or []:
            if isinstance(row, dict) and row.get("name"):
                x, mfu = row.get("speedup_vs_fp32"), row.get("mfu")
                out[f"{g.get('name')}/{row['name']} speed"] = (
                    f"{_fmt(row.get('tokens_per_sec'), digits=0)} tokens/s, x fp32 {_fmt(x)}, MFU {_fmt(mfu, pct=True)}"
                )
    return out


def sweep_runs(sweep_dir: Path) -> dict[str, Any]:
    """Each finished run's figures from its own summary.json (written when the run ends)."""
    runs: dict[str, Any] = {}
    for path in sorted(sweep_dir.glob("**/summary.json")):
        if path.parent == sweep_dir:
            continue
        d = _read_json(path) or {}
        if "status" not in d or "steps" not in d:
            continue
        ev = d.get("final_eval") or {}
        tp = d.get("throughput") or {}
        runs[str(path.parent.relative_to(sweep_dir))] = {
            "status": d.get("status"),
            "steps": d.get("steps"),
            "eval_mlm_loss": ev.get("eval/loss_mlm"),
            "tokens_per_sec": tp.get("tokens_per_sec", tp.get("throughput/tokens_per_sec")),
            "mfu": tp.get("mfu", tp.get("throughput/mfu")),
        }
    return runs


SWEEP_SIZES = {
    # config, output folder, corpus bytes
    "short": ("configs/sweep_gpu_short.yaml", "runs/sweep_gpu_short", 12 * 2**20),
    "long": ("configs/sweep_gpu_base.yaml", "runs/sweep_gpu_base", 400 * 2**20),
    "dry": ("configs/sweep_gpu_short.yaml", "runs/gpu_check/sweep_dry", 256 * 2**10),
}
DRY_SWEEP = [
    "model.preset=tiny",
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.eval_max_batches=1",
    "data.vocab_size=500",
    "data.num_proc=1",
    "sweep.precisions=[fp32]",
    "sweep.profile_steps=0",
    "sweep.parity_window=2",
    "data.max_seq_length=32",
    "sweep.output_dir=runs/gpu_check/sweep_dry",
]


def phase_sweep(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    size = "dry" if args.dry_run else ("long" if args.long_sweep else "short")
    config, out_rel, corpus_bytes = SWEEP_SIZES[size]
    corpus = ROOT / "runs" / "gpu_corpus"
    stats = corpus / "stats.json"
    if (_read_json(stats) or {}).get("max_bytes") != corpus_bytes:  # none yet, or another size's
        shutil.rmtree(corpus, ignore_errors=True)
        info = write_docstring_corpus(corpus, corpus_bytes)
        stats.write_text(json.dumps({**info, "max_bytes": corpus_bytes}))
    corpus_info = {**json.loads(stats.read_text()), "seconds": round(time.monotonic() - t0, 1)}
    out_dir = ROOT / out_rel
    cmd = [sys.executable, "-m", "bert_mp", "sweep", config, *(DRY_SWEEP if args.dry_run else [])]

    def tick() -> None:
        args.progress({"config": config, "corpus": corpus_info, "runs": sweep_runs(out_dir)})

    rc, tail = _run(cmd, args.budget - (time.monotonic() - t0), STATE / "sweep.log", tick=tick)
    report = _read_json(out_dir / "summary.json")
    return {
        "status": "ok"
        if rc == 0
        else ("incomplete: run the sweep again (it resumes)" if rc == 124 else "failed"),
        "rc": rc,
        "config": config,
        "corpus": corpus_info,
        "runs": sweep_runs(out_dir),
        "verdicts": sweep_verdicts(report) if report else None,
        "tail": tail[-2000:],
    }


RUNNERS = {
    "install": phase_install,
    "ladder": phase_ladder,
    "paths": phase_paths,
    "tests": phase_tests,
    "kernels": phase_kernels,
    "profile": phase_profile,
    "levers": phase_levers,
    "large": phase_large,
    "compile": phase_compile,
    "sweep": phase_sweep,
}


# --------------------------------------------------------------------------------------------------
# what goes back: at most MAX_OUT_FILES files, rewritten whenever something new is known
# --------------------------------------------------------------------------------------------------
class Publisher:
    """Writes this command's phase files, the summary and the log into OUT_DIR (again and again)."""

    def __init__(self, out: Path, phases: list[str]):
        self.out, self.phases, self.lines = out, phases, []
        self.last = 0.0
        out.mkdir(parents=True, exist_ok=True)

    def say(self, line: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S', time.gmtime())}] {line}"
        print(line, flush=True)
        self.lines.append(line)

    def phase_file(self, name: str, res: dict[str, Any]) -> None:
        (STATE / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))

    def progress(self, name: str, partial: dict[str, Any]) -> None:
        """A running phase's partial results, published at most every TICK_S seconds."""
        if time.monotonic() - self.last < TICK_S:
            return
        self.phase_file(name, {"status": "running", "phase": name, **partial})
        self.publish()

    def publish(self) -> None:
        self.last = time.monotonic()
        loaded = {n: _read_json(STATE / f"{n}.json") for n in PHASES if n != "summary"}
        summary = build_summary(loaded)
        (STATE / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        (STATE / "summary.md").write_text(summary_markdown(summary))
        names = [n for n in PHASES if n != "summary" and loaded.get(n) is not None]
        mine = [n for n in names if n in self.phases] or names  # `summary` alone: whatever is there
        files = [STATE / f"{n}.json" for n in mine] + [STATE / "summary.json", STATE / "summary.md"]
        if len(files) + 1 > MAX_OUT_FILES:  # install's facts are in summary.json too
            files = [f for f in files if f.name != "install.json"][: MAX_OUT_FILES - 1]
        for f in files:
            tmp = self.out / (f.name + ".tmp")
            shutil.copy(f, tmp)
            tmp.replace(self.out / f.name)
        (self.out / LOG_NAME).write_text(self.log_text(loaded))

    def log_text(self, loaded: dict[str, Any]) -> str:
        """The command's own lines, then per phase of this command: the full text of each failing
        test, and the child's whole log (capped) where the phase did not end ok."""
        parts = ["\n".join(self.lines)]
        for name in self.phases:
            res = loaded.get(name) or {}
            for test, text in (res.get("failures") or {}).items():
                parts.append(f"\n===== FAILED {test} =====\n{text}")
            bench = ("ladder", "compile", "paths", "levers", "large")
            child = STATE / f"{'bench_' + name if name in bench else name}.log"
            if res.get("status") not in (None, "ok", "running") and child.exists():
                text = child.read_text(errors="replace")
                parts.append(f"\n===== {name}: {res.get('status')}, {child.name} =====\n{text[-LOG_CAP:]}")
        return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("phases", nargs="*", help=f"{', '.join(PHASES)} (default: {' '.join(DEFAULT_PHASES)})")
    p.add_argument(
        "--dry-run", action="store_true", help="tiny model, few steps: test the plumbing on any device"
    )
    p.add_argument(
        "--rehearse", action="store_true", help="the docs/gpu.md sequence on this CPU, fresh each command"
    )
    p.add_argument("--force", action="store_true", help="rerun phases that already completed on this machine")
    p.add_argument(
        "--budget", action="append", default=[], metavar="PHASE=SECONDS", help="override a phase budget"
    )
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole command")
    p.add_argument("--test-timeout", type=float, default=None, help="seconds per test (tests phase)")
    p.add_argument(
        "--long-sweep", action="store_true", help="configs/sweep_gpu_base.yaml (1000 steps, resumes)"
    )
    p.add_argument("--wheels", default=str(WHEELS), help="folder of carried wheels (default .wheels)")
    p.add_argument("--micro-batch", type=int, default=256, help="ladder micro-batch (BERT-base, seq 128)")
    args = p.parse_args(argv)
    if args.rehearse:
        return rehearse(Path(args.out_dir))
    phases = list(args.phases or DEFAULT_PHASES)
    bad = [x for x in phases if x not in PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {', '.join(PHASES)}")
    if phases != ["summary"] and "install" not in phases and not (SITE / INSTALLED).exists():
        phases.insert(0, "install")  # a fresh machine: every command installs what it needs
    if len([x for x in phases if x != "summary"]) > MAX_OUT_FILES - 3:
        p.error(f"at most {MAX_OUT_FILES - 3} phases per command (at most {MAX_OUT_FILES} files come back)")
    budgets = dict(BUDGETS_DRY if args.dry_run else BUDGETS)
    for item in args.budget:
        name, _, sec = item.partition("=")
        budgets[name] = float(sec)
    args.test_timeout = args.test_timeout or (60.0 if args.dry_run else 120.0)
    STATE.mkdir(parents=True, exist_ok=True)
    pub = Publisher(Path(args.out_dir), phases)
    started = time.monotonic()
    ran = []
    for name in phases:
        if name == "summary":
            continue
        left = args.deadline - (time.monotonic() - started) - RESERVE_S
        args.budget = min(budgets[name], left)
        path = STATE / f"{name}.json"
        if path.exists() and not args.force and (_read_json(path) or {}).get("status") == "ok":
            pub.say(f"{name}: done before on this machine (use --force to rerun)")
            continue
        if left < MIN_PHASE_S:
            pub.say(
                f"{name}: not started, {left:.0f} s left of --deadline {args.deadline:.0f}; run it in the next command"
            )
            pub.phase_file(name, {"status": "not started: out of time", "phase": name})
            continue
        pub.say(f"{name}: started, budget {args.budget:.0f} s")
        args.progress = lambda partial, n=name: pub.progress(n, partial)
        t = time.monotonic()
        try:
            res = RUNNERS[name](args)
        except Exception as e:  # a broken phase is recorded, the others still run
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        res.update(
            phase=name, seconds=round(time.monotonic() - t, 1), budget_s=args.budget, dry_run=args.dry_run
        )
        pub.phase_file(name, res)
        ran.append(name)
        pub.say(f"{name}: {res['status']} in {res['seconds']} s")
        pub.publish()
    pub.say(f"done in {time.monotonic() - started:.0f} s; files in {args.out_dir}")
    pub.publish()
    print((STATE / "summary.md").read_text())
    failed = [n for n in ran if (_read_json(STATE / f"{n}.json") or {}).get("status") != "ok"]
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# the CPU rehearsal of the GPU sequence (CI runs it: tests/integration/test_gpu_check_rehearsal.py)
# --------------------------------------------------------------------------------------------------
def _repository_files() -> list[str]:
    """What a fresh clone holds (tracked and new files), or the tree without local state."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".gpu_site", ".wheels", "runs", "__pycache__"}
        return [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
        ]


def rehearse(out: Path) -> int:
    """Run COMMANDS as docs/gpu.md gives them, with ``--dry-run``, each as on a fresh machine.

    A copy of the repository's tracked files stands in for the machine; ``.gpu_site/`` and
    ``runs/`` are deleted before each command, every command gets its own OUT folder, and each
    must leave its phase files, the summary and the log (at most MAX_OUT_FILES files).
    """
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    files = _repository_files()
    record: dict[str, Any] = {"commands": [], "ok": True}
    with tempfile.TemporaryDirectory(prefix="gpu_rehearsal_") as tmp:
        machine = Path(tmp) / "repo"
        for f in files:
            src = ROOT / f
            if src.is_file():
                (machine / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, machine / f)
        for i, phases in enumerate(COMMANDS, 1):
            shutil.rmtree(machine / ".gpu_site", ignore_errors=True)  # a fresh machine each command
            shutil.rmtree(machine / "runs", ignore_errors=True)
            cmd_out = out / f"command_{i}"
            shutil.rmtree(cmd_out, ignore_errors=True)
            argv = ["bash", "scripts/gpu_check.sh", str(cmd_out), *phases, "--dry-run"]
            t = time.monotonic()
            env = {**_clean_env(), "PYTHON": sys.executable}
            proc = subprocess.run(argv, cwd=machine, capture_output=True, text=True, env=env)
            seconds = round(time.monotonic() - t, 1)
            got = sorted(x.name for x in cmd_out.iterdir()) if cmd_out.exists() else []
            want = [f"{n}.json" for n in ("install", *phases)] + ["summary.json", "summary.md", LOG_NAME]
            missing = [w for w in want if w not in got]
            statuses = {
                n: (_read_json(cmd_out / f"{n}.json") or {}).get("status") for n in ("install", *phases)
            }
            phase_s = {
                n: (_read_json(cmd_out / f"{n}.json") or {}).get("seconds") for n in ("install", *phases)
            }
            ok = proc.returncode == 0 and not missing and len(got) <= MAX_OUT_FILES
            record["commands"].append(
                {
                    "command": " ".join(["bash scripts/gpu_check.sh $OUT", *phases]),
                    "rc": proc.returncode,
                    "seconds": seconds,
                    "phase_seconds": phase_s,
                    "statuses": statuses,
                    "files": got,
                    "missing": missing,
                    "ok": ok,
                }
            )
            record["ok"] &= ok
            print(
                f"[rehearse] command {i}: {' '.join(phases)}: rc {proc.returncode}, {seconds} s, {statuses}"
                + (f", MISSING {missing}" if missing else ""),
                flush=True,
            )
            if not ok:
                print(proc.stdout[-3000:] + proc.stderr[-3000:])
    (out / "rehearsal.json").write_text(json.dumps(record, indent=1))
    print(f"[rehearse] {'ok' if record['ok'] else 'FAILED'}: {out / 'rehearsal.json'}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
