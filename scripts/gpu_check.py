"""Validate bert_mp on a bare GPU machine in phases that each fit a 10-minute command.

    python scripts/gpu_check.py OUT_DIR [PHASE ...] [--dry-run] [--force] [--budget SECONDS]

Phases (default: ``install tests ladder summary``; ``all`` adds ``compile`` and ``sweep``):

- ``install``: puts the carried wheels (``.wheels/``, from ``scripts/gpu_wheels.sh``) that this
  machine lacks into ``.gpu_site/`` (``pip install --no-index --no-deps --target``): no download,
  no torch. The machine's ``python3`` may itself be a virtual environment (the lent machines'
  is), so a new ``--system-site-packages`` venv would not see its torch; a target folder on
  ``PYTHONPATH`` does. For ``datasets`` the newest carried release whose requirements the
  machine's own packages meet is chosen (it cannot upgrade pyarrow or huggingface_hub).
- ``tests``: ``pytest -m gpu`` (tests/unit/pretrain/test_gpu.py, tests/integration/test_gpu_resume.py)
  plus the CPU tests of the CUDA-path logic (tests/unit/core/test_cuda_paths.py).
- ``ladder``: ``scripts/bench_train.py`` on BERT-base, seq 128: HF baselines (strict fp32 and bf16
  autocast) and bert_mp in fp32 / tf32 / bf16 / fp16, same batches on the same device; then the
  kernel probe per precision (GEMM and attention verdicts, top kernels by device time).
- ``compile``: the ladder again with ``train.compile=model``.
- ``sweep``: writes a real-sized offline text corpus (docstrings of the installed packages) and runs
  ``configs/sweep_gpu_base.yaml`` (1000 steps, parity verdicts) under the time budget; the sweep
  resumes, so run the phase again until it reports ``complete``.
- ``summary``: one ``summary.json`` + ``summary.md`` with the targets checked.

State lives in ``runs/gpu_check/`` (a phase that completed is skipped unless ``--force``); every
invocation copies the phase files and the summary into OUT_DIR. ``--dry-run`` runs the same code
on this machine's device with a tiny model and a few steps (to test the plumbing on a CPU).
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
WHEELS = ROOT / ".wheels"
PHASES = ("install", "tests", "ladder", "compile", "sweep", "summary")
DEFAULT_PHASES = ("install", "tests", "ladder", "summary")
CARRIED = ("datasets", "dill", "multiprocess", "xxhash", "fsspec", "omegaconf")
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
        "targets": check_targets(rows),
        "targets_compiled": check_targets(crow) if crow else None,
        "kernel_check": ladder.get("kernels"),
        "sweep": (phases.get("sweep") or {}).get("verdicts"),
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
            f"`pytest -m gpu`: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped.",
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
    if s.get("kernel_check"):
        lines += ["", "## Kernel check (by kernel name)", ""]
        for prec, k in s["kernel_check"].items():
            if isinstance(k, dict) and "verdict" in k:
                lines.append(f"- {prec}: {k['verdict']}")
            else:
                lines.append(f"- {prec}: {k}")
    if s.get("sweep"):
        lines += ["", "## 1000-step sweep parity verdicts", ""]
        for name, v in s["sweep"].items():
            lines.append(f"- {name}: {v}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# phases (these run the real thing)
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


def _run(cmd: list[str], timeout: float, log: Path) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; on timeout SIGTERM the group (runs save and stop)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            rc = 124  # cut at the deadline (the children were asked to save and stop)
    return rc, log.read_text(errors="replace")[-4000:]


def _device_info() -> dict[str, Any]:
    code = (
        "import json, torch, transformers, accelerate, sys\n"
        "d = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'transformers': transformers.__version__, 'accelerate': accelerate.__version__}\n"
        "import datasets, omegaconf; d['datasets'] = datasets.__version__; d['omegaconf'] = omegaconf.__version__\n"
        "import bert_mp.pretrain.trainer\n"
        "dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu (no CUDA)'\n"
        "cap = '.'.join(map(str, torch.cuda.get_device_capability(0))) if torch.cuda.is_available() else None\n"
        "print(json.dumps({'versions': d, 'device': dev, 'capability': cap, 'bert_mp': bert_mp.__file__}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def phase_install(args: argparse.Namespace) -> dict[str, Any]:
    wheels = sorted(Path(args.wheels).glob("*.whl"))
    installed = installed_versions(sys.executable)
    missing = [n for n in CARRIED if n not in installed]
    chosen, problems = choose_wheels(wheels, installed) if wheels else ({}, [])
    res: dict[str, Any] = {"machine_has": {n: installed.get(n) for n in CARRIED}, "missing": missing}
    if chosen:
        SITE.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--upgrade",
            "--target",
            str(SITE),
            *map(str, chosen.values()),
        ]
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
    return res


def phase_tests(args: argparse.Namespace) -> dict[str, Any]:
    junit = STATE / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu or not slow",
        "-rfE",
        f"--junitxml={junit}",
        "tests/unit/pretrain/test_gpu.py",
        "tests/integration/test_gpu_resume.py",
        "tests/unit/core/test_cuda_paths.py",
    ]
    rc, tail = _run(cmd, args.budget, STATE / "tests.log")
    counts, failed = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}, []
    if junit.exists():
        import xml.etree.ElementTree as ET

        for case in ET.parse(junit).getroot().iter("testcase"):
            tag = {c.tag for c in case}
            name = f"{case.get('classname')}::{case.get('name')}"
            if "failure" in tag or "error" in tag:
                counts["failed" if "failure" in tag else "errors"] += 1
                failed.append(name)
            elif "skipped" in tag:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    status = "ok" if rc == 0 else ("timeout" if rc == 124 else "failed")
    return {"status": status, "rc": rc, "counts": counts, "failed": failed, "tail": tail}


def _bench(args: argparse.Namespace, compile_mode: str, name: str) -> dict[str, Any]:
    out = STATE / f"bench_{name}.json"
    if args.dry_run:
        size = [
            "--preset",
            "tiny",
            "--vocab",
            "300",
            "--seq",
            "32",
            "--micro-batch",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
        ]
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
            "--steps",
            "20",
            "--warmup",
            "5",
        ]
    # compiled: the 16-bit modes and tf32 (fp32's speed-up reference comes from the ladder phase)
    precisions = "fp32,tf32,bf16,fp16" if compile_mode == "none" else "bf16,fp16,tf32"
    baselines = "fp32,bf16" if compile_mode == "none" else "fp32"
    cmd = [
        sys.executable,
        "scripts/bench_train.py",
        *size,
        "--repeat",
        "1",
        "--precisions",
        precisions,
        "--baseline-precisions",
        baselines,
        "--compile",
        compile_mode,
        "--out",
        str(out),
    ]
    rc, tail = _run(
        cmd, args.budget * (0.75 if compile_mode == "none" else 0.95), STATE / f"bench_{name}.log"
    )
    bench = json.loads(out.read_text()) if out.exists() and rc == 0 else None
    return {"rc": rc, "bench": bench, "tail": tail if rc else tail[-800:]}


def _kernels(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """The kernel probe per precision in a child process (a failure there cannot sink the ladder)."""
    out = STATE / "kernels.json"
    preset, batch, seq = ("tiny", 4, 32) if args.dry_run else ("base", 32, 128)
    code = f"""
import json, torch
from transformers import BertForPreTraining
from bert_mp.core.config import ModelConfig
from bert_mp.sweep.diagnostics import probe_precision, synthetic_batch
from bert_mp.errors import HardwareError
from bert_mp.model.bert import PretrainingModel, bert_config
from bert_mp.core.precision import resolve_precision
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
res = {{}}
for prec in ("fp32", "tf32", "bf16", "fp16"):
    try:
        plan = resolve_precision(prec, dev)
    except HardwareError as e:
        res[prec] = "skipped: " + str(e)
        continue
    torch.manual_seed(0)
    model = PretrainingModel(BertForPreTraining(bert_config(ModelConfig(preset="{preset}"), 30528)), max_predictions_per_seq=20).to(dev)
    r = probe_precision(model, synthetic_batch(30528 if "{preset}" == "base" else 300, {batch}, {seq}, dev), plan, steps=2)
    res[prec] = {{"verdict": r["kernel_verdict"], "check": r.get("cuda_kernel_check"),
                 "top_kernels": r["cuda_kernels"][:12], "padding_fraction": r["batch_padding_fraction"],
                 "measured_bytes": r["measured_bytes"]}}
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
json.dump(res, open("{out}", "w"), indent=1, default=str)
"""
    rc, tail = _run([sys.executable, "-c", code], budget, STATE / "kernels.log")
    if rc == 0 and out.exists():
        return json.loads(out.read_text())
    return {"error": f"rc {rc}: {tail[-1500:]}"}


def phase_ladder(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    res = _bench(args, "none", "ladder")
    res["kernels"] = _kernels(args, max(60.0, args.budget - (time.monotonic() - t0)))
    res["device"] = (res.get("bench") or {}).get("device")
    res["status"] = "ok" if res["rc"] == 0 else ("timeout" if res["rc"] == 124 else "failed")
    return res


def phase_compile(args: argparse.Namespace) -> dict[str, Any]:
    res = _bench(args, "model", "compile")
    res["status"] = "ok" if res["rc"] == 0 else ("timeout" if res["rc"] == 124 else "failed")
    return res


def write_docstring_corpus(dest: Path, max_bytes: int, roots: list[Path] | None = None) -> dict[str, Any]:
    """Real English text offline: module/class/function docstrings of installed Python packages.

    One document per module (its docstrings, a blank line between documents), written to
    ``dest/corpus_NN.txt`` until ``max_bytes``. Deterministic order (sorted paths).
    """
    import site

    dest.mkdir(parents=True, exist_ok=True)
    roots = roots or [
        Path(p) for p in {*site.getsitepackages(), *sys.path} if p and Path(p).is_dir() and "packages" in p
    ]
    written, docs, shard, fh = 0, 0, 0, None
    for root in sorted(set(roots)):
        for path in sorted(root.rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except (SyntaxError, ValueError, OSError, RecursionError):
                continue
            parts = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc.split()) >= 8:
                        parts.append(" ".join(doc.split()))
            if not parts:
                continue
            if fh is None or fh.tell() > 64 * 2**20:
                if fh:
                    fh.close()
                fh = open(dest / f"corpus_{shard:02d}.txt", "w", encoding="utf-8")  # noqa: SIM115 (rotating shards)
                shard += 1
            text = "\n".join(parts) + "\n\n"
            fh.write(text)
            written += len(text.encode())
            docs += 1
            if written >= max_bytes:
                break
        if written >= max_bytes:
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


def phase_sweep(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    corpus = ROOT / "runs" / "gpu_corpus"
    stats = corpus / "stats.json"
    if not stats.exists():
        info = write_docstring_corpus(corpus, 2 * 2**20 if args.dry_run else 400 * 2**20)
        stats.write_text(json.dumps(info))
    corpus_info = json.loads(stats.read_text())
    overrides = []
    if args.dry_run:
        overrides = [
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
    remaining = args.budget - (time.monotonic() - t0)
    cmd = [sys.executable, "-m", "bert_mp", "sweep", "configs/sweep_gpu_base.yaml", *overrides]
    rc, tail = _run(cmd, remaining, STATE / "sweep.log")
    out_dir = ROOT / ("runs/gpu_check/sweep_dry" if args.dry_run else "runs/sweep_gpu_base")
    report = out_dir / "summary.json"
    verdicts = sweep_verdicts(json.loads(report.read_text())) if report.exists() else None
    status = (
        "ok" if rc == 0 else ("incomplete: run the sweep phase again (it resumes)" if rc == 124 else "failed")
    )
    return {"status": status, "rc": rc, "corpus": corpus_info, "verdicts": verdicts, "tail": tail[-2000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument(
        "phases", nargs="*", help=f"{', '.join(PHASES)} or all (default: {' '.join(DEFAULT_PHASES)})"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="tiny model, few steps: test the plumbing on any device"
    )
    p.add_argument("--force", action="store_true", help="rerun phases that already completed")
    p.add_argument(
        "--budget", type=float, default=540.0, help="seconds for each long phase (a command may run 600)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=570.0,
        help="seconds for the whole invocation (phases are cut to fit)",
    )
    p.add_argument("--wheels", default=str(WHEELS), help="folder of carried wheels (default .wheels)")
    p.add_argument("--micro-batch", type=int, default=256, help="ladder micro-batch (BERT-base, seq 128)")
    args = p.parse_args(argv)
    phases = list(args.phases or DEFAULT_PHASES)
    if phases == ["all"]:
        phases = list(PHASES)
    bad = [x for x in phases if x not in PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {', '.join(PHASES)} or all")
    STATE.mkdir(parents=True, exist_ok=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runners = {
        "install": phase_install,
        "tests": phase_tests,
        "ladder": phase_ladder,
        "compile": phase_compile,
        "sweep": phase_sweep,
    }
    started = time.monotonic()
    phase_budget = args.budget
    for name in phases:
        if name == "summary":
            continue
        # one command may run 10 minutes: every phase gets at most what is left of --deadline
        left = args.deadline - (time.monotonic() - started) - 20.0
        args.budget = min(phase_budget, left)
        if left < 60.0:
            print(
                f"[gpu_check] {name}: not started, {left:.0f} s left of --deadline; run it in the next command"
            )
            continue
        path = STATE / f"{name}.json"
        if path.exists() and not args.force and json.loads(path.read_text()).get("status") == "ok":
            print(f"[gpu_check] {name}: done before (use --force to rerun)", flush=True)
            continue
        print(f"[gpu_check] {name} ...", flush=True)
        t = time.monotonic()
        try:
            res = runners[name](args)
        except Exception as e:  # a broken phase is recorded, the others still run
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        res.update(phase=name, seconds=round(time.monotonic() - t, 1), dry_run=args.dry_run)
        path.write_text(json.dumps(res, indent=1, default=str))
        print(f"[gpu_check] {name}: {res['status']} in {res['seconds']} s", flush=True)
    loaded = {
        n: json.loads((STATE / f"{n}.json").read_text()) if (STATE / f"{n}.json").exists() else None
        for n in PHASES
        if n != "summary"
    }
    summary = build_summary(loaded)
    (STATE / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (STATE / "summary.md").write_text(summary_markdown(summary))
    for n in [*[x for x in PHASES if x != "summary"], "summary"]:
        src = STATE / f"{n}.json"
        if src.exists():
            shutil.copy(src, out / src.name)
    shutil.copy(STATE / "summary.md", out / "summary.md")
    print(summary_markdown(summary))
    print(f"[gpu_check] wrote {out}/summary.json and summary.md ({time.monotonic() - started:.0f} s)")
    failed = [n for n in phases if n != "summary" and (loaded.get(n) or {}).get("status") not in ("ok", None)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
