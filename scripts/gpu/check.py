"""The GPU check (docs/gpu.md): the CUDA tests, a benchmark row and a short precision sweep on this
machine's GPU within a time budget, each result in OUT the moment it is measured.

    bash scripts/gpu_check.sh OUT [--phases tests,bench,sweep] [--budget SECONDS] [--dry-run]
    bash scripts/gpu_check.sh OUT --rehearse      # the dry run in a fresh copy of the repository

Each phase is a child process in its own process group with its share of what is left of the budget
(:data:`PHASES`; time a phase leaves unused goes to the next). At the end of its share it is cut
(SIGTERM: a training run saves and stops) and keeps every row it wrote. OUT holds ``PHASE.json`` per
phase (rewritten while it runs), ``summary.json`` (device, versions, each phase's status, seconds and
rows) and ``check.log`` (what the children printed). Exit 0 when every phase ran whole.
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
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"tests": 1, "bench": 1, "sweep": 2}
"""Phase -> its weight in the budget (the sweep trains the most)."""
GPU_TESTS = (
    "tests/unit/pretrain/test_gpu.py",
    "tests/integration/test_gpu_resume.py",
    "tests/unit/core/test_cuda_paths.py",
    "tests/unit/pretrain/test_sync_budget.py",
)
BENCH = "--preset base --vocab 30522 --seq 128 --micro-batch 256 --steps 20 --warmup 5 --precisions fp32,bf16"
BENCH_DRY = "--preset tiny --vocab 300 --seq 32 --micro-batch 4 --steps 1 --warmup 1 --precisions fp32"
SWEEP_DRY = [
    "model.preset=tiny",
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
]
SWEEP_DRY += ["train.warmup_steps=1", "train.eval_every=0", "train.eval_max_batches=1", "data.vocab_size=500"]
SWEEP_DRY += ["data.num_proc=1", "sweep.precisions=[fp32]", "sweep.recipe_precision=fp32"]
SWEEP_DRY += ["sweep.profile_steps=0", "sweep.parity_window=2", "data.max_seq_length=32"]
CORPUS = ROOT / "runs" / "gpu_corpus"
VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", re.MULTILINE)
"""A test's line in ``pytest -v`` output."""


def docstrings(path: Path) -> str:
    """A module's docstrings of eight words or more, one line each: one document of real English."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    parts = [" ".join(d.split()) for d in docs if d and len(d.split()) >= 8]
    return "\n".join(parts) + "\n\n" if parts else ""


def write_docstring_corpus(dest: Path, max_bytes: int, roots: list[Path]) -> dict[str, int]:
    """The docstrings of the Python files under ``roots`` (sorted: the same text on every run), one
    document per module, into ``dest/corpus.txt`` until ``max_bytes``: a corpus written offline."""
    dest.mkdir(parents=True, exist_ok=True)
    written = docs = 0
    with open(dest / "corpus.txt", "w", encoding="utf-8") as fh:
        for path in (p for root in sorted(roots) for p in sorted(root.rglob("*.py"))):
            if text := docstrings(path):
                fh.write(text)
                written, docs = written + len(text.encode()), docs + 1
                if written >= max_bytes:
                    break
    return {"bytes": written, "documents": docs}


def tests_phase(args: argparse.Namespace, state: Path) -> tuple[list[str], Path]:
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu or not slow", "-rfE"]
    cmd += [f"--junitxml={state / 'junit.xml'}", *GPU_TESTS, *(["-k", args.tests_k] if args.tests_k else [])]
    (state / "junit.xml").unlink(missing_ok=True)
    # the verbose lines also into tests.log: a run cut before pytest writes its report is counted from them
    tee = f'set -o pipefail; "$@" 2>&1 | tee {state / "tests.log"}'
    return ["bash", "-c", tee, "pytest", *cmd], state / "junit.xml"


def bench_phase(args: argparse.Namespace, state: Path) -> tuple[list[str], Path]:
    size = (BENCH_DRY if args.dry_run else BENCH).split()
    out = state / "bench.json"
    return [sys.executable, "scripts/bench/train.py", *size, "--repeat", "1", "--out", str(out)], out


def sweep_phase(args: argparse.Namespace, state: Path) -> tuple[list[str], Path]:
    if not (CORPUS / "corpus.txt").is_file():  # real text, offline: the installed packages' docstrings
        roots = {Path(p) for p in sys.path if p.endswith("-packages") and Path(p).is_dir()}
        write_docstring_corpus(CORPUS, (64 * 2**10) if args.dry_run else (12 * 2**20), sorted(roots))
    out = ROOT / "runs" / ("gpu_check_sweep" if args.dry_run else "sweep_gpu_short")
    cmd = [
        sys.executable,
        "-m",
        "bert_mp",
        "sweep",
        "configs/sweep_gpu_short.yaml",
        f"sweep.output_dir={out}",
    ]
    return cmd + (SWEEP_DRY if args.dry_run else []), out


def rows(phase: str, found: Path) -> dict[str, Any]:
    """What a phase has measured so far, read from what its child wrote (nothing yet: empty)."""
    if phase == "tests" and not found.is_file() and found.with_name("tests.log").is_file():
        lines = VERBOSE.findall(found.with_name("tests.log").read_text(errors="replace"))
        failed = [name for name, outcome in lines if outcome in ("FAILED", "ERROR")]
        skipped = sum(outcome == "SKIPPED" for _, outcome in lines)
        return (
            {"passed": len(lines) - len(failed) - skipped, "skipped": skipped, "failed": failed}
            if lines
            else {}
        )
    if phase == "tests" and found.is_file():
        import xml.etree.ElementTree as ET

        cases = list(ET.parse(found).getroot().iter("testcase"))
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None]
        failed += [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("error") is not None]
        skipped = sum(c.find("skipped") is not None for c in cases)
        return {"passed": len(cases) - len(failed) - skipped, "skipped": skipped, "failed": failed}
    if phase == "bench" and found.is_file():
        res = json.loads(found.read_text()).get("results") or {}
        return {k: v for k, v in res.items() if isinstance(v, dict) and v.get("tokens_per_sec")}
    if phase == "sweep":
        runs = {}
        for path in sorted(found.glob("runs/*/summary.json")):
            s = json.loads(path.read_text())
            tp = s.get("throughput") or {}
            eval_loss = (s.get("final_eval") or {}).get("eval/loss_mlm")
            runs[path.parent.name] = {
                "status": s.get("status"),
                "steps": s.get("steps"),
                "eval_mlm_loss": eval_loss,
            }
            runs[path.parent.name].update(tokens_per_sec=tp.get("tokens_per_sec"), mfu=tp.get("mfu"))
        report = found / "summary.json"
        groups = (json.loads(report.read_text()).get("groups") or []) if report.is_file() else []
        verdicts = {f"{g['name']}/{run}": v["status"] for g in groups for run, v in g["verdicts"].items()}
        return {"runs": runs, "verdicts": verdicts} if runs else {}
    return {}


def count(phase: str, measured: dict[str, Any]) -> int:
    """How many rows ``phase`` measured: tests run, benchmark rows, sweep runs that trained a step."""
    if phase == "tests":
        return measured.get("passed", 0) + len(measured.get("failed", []))
    if phase == "sweep":
        return sum(1 for r in (measured.get("runs") or {}).values() if r.get("steps"))
    return len(measured)


def run_phase(phase: str, cmd: list[str], found: Path, seconds: float, out: Path, log) -> dict[str, Any]:
    """Run a phase's child for at most ``seconds``, ``out/PHASE.json`` rewritten every few seconds."""
    t0, env = time.monotonic(), {**os.environ, "BERT_MP_TEST_TIMEOUT": "120"}  # per test (tests/conftest.py)
    child = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    status = None
    while status is None:
        try:
            left = seconds - (time.monotonic() - t0)
            status = "ok" if child.wait(timeout=min(5.0, max(0.1, left))) == 0 else "failed"
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 > seconds:
                os.killpg(child.pid, signal.SIGTERM)  # a training run saves and stops
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                status = "timeout"
        measured = rows(phase, found)
        record = {
            "status": status or "running",
            "seconds": round(time.monotonic() - t0, 1),
            "budget_s": seconds,
        }
        write_json(out / f"{phase}.json", {**record, "rows": count(phase, measured), "measured": measured})
    return record | {"rows": count(phase, measured)}


def write_json(path: Path, data: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data, indent=1, default=str))
    path.with_suffix(".tmp").replace(path)  # never half-written


def machine() -> dict[str, Any]:
    code = "import json, torch, transformers; c = torch.cuda.is_available(); print(json.dumps({'device': "
    code += "torch.cuda.get_device_name() if c else 'cpu', 'torch': torch.__version__, "
    code += "'transformers': transformers.__version__, 'cuda': torch.version.cuda}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}


def check(args: argparse.Namespace) -> int:
    out, state = Path(args.out_dir), ROOT / "runs" / "gpu_check"
    out.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "machine": machine(),
        "budget_s": args.budget,
        "dry_run": args.dry_run,
        "phases": {},
    }
    start, phases = time.monotonic(), args.phases.split(",")
    with open(out / "check.log", "w") as log:
        for i, phase in enumerate(phases):
            left = args.budget - (time.monotonic() - start)
            share = round(left * PHASES[phase] / sum(PHASES[p] for p in phases[i:]), 1)
            print(f"[gpu_check] {phase}: {share:.0f} s of the {left:.0f} s left", flush=True)
            log.write(f"===== {phase} =====\n")
            log.flush()
            cmd, found = {"tests": tests_phase, "bench": bench_phase, "sweep": sweep_phase}[phase](
                args, state
            )
            summary["phases"][phase] = run_phase(phase, cmd, found, share, out, log)
            write_json(out / "summary.json", summary)
            print(f"[gpu_check] {phase}: {summary['phases'][phase]}", flush=True)
    return 0 if all(r["status"] == "ok" for r in summary["phases"].values()) else 1


def judge(out: Path, phases: list[str], rc: int) -> dict[str, Any]:
    """A check's verdict from what it left in ``out``: files missing, each phase's status and rows, and
    the phases that hung (cut with nothing measured). A slow machine's cut after rows is not a hang."""
    want = [f"{p}.json" for p in phases] + ["summary.json", "check.log"]
    missing = [w for w in want if not (out / w).is_file()]
    results = {p: json.loads((out / f"{p}.json").read_text()) for p in phases if f"{p}.json" not in missing}
    statuses = {p: r["status"] for p, r in results.items()}
    hung = [p for p, r in results.items() if r["status"] == "timeout" and not r["rows"]]
    measured = {p: r["rows"] for p, r in results.items()}
    ok = rc == 0 and not missing and not hung
    return {"statuses": statuses, "rows": measured, "hung": hung, "missing": missing, "ok": ok}


def rehearse(args: argparse.Namespace) -> int:
    """The dry run in a copy of the repository's files (no runs/, no .venv): what a fresh clone does."""
    out = Path(args.out_dir).resolve()
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    with tempfile.TemporaryDirectory(prefix="gpu_rehearsal_") as tmp:
        for rel in files.stdout.splitlines():
            if (ROOT / rel).is_file():
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, Path(tmp) / rel)
        argv = ["bash", "scripts/gpu_check.sh", str(out / "check"), "--dry-run", "--budget", str(args.budget)]
        argv += ["--phases", args.phases] + (["--tests-k", args.tests_k] if args.tests_k else [])
        env = {**os.environ, "PYTHON": sys.executable}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True)
    verdict = judge(out / "check", args.phases.split(","), proc.returncode) | {"rc": proc.returncode}
    write_json(out / "rehearsal.json", verdict)
    print(proc.stdout[-3000:] + proc.stderr[-3000:] if not verdict["ok"] else "", f"[rehearse] {verdict}")
    return 0 if verdict["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated, in order (default: all)")
    p.add_argument("--budget", type=float, default=1200.0, help="seconds for all phases (default 1200)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on any device: the plumbing")
    p.add_argument("--rehearse", action="store_true", help="the dry run in a fresh copy of the repository")
    p.add_argument("--tests-k", default="", help="a pytest -k expression for the tests phase")
    args = p.parse_args(argv)
    bad = [x for x in args.phases.split(",") if x not in PHASES]
    if bad or args.budget <= 0:
        p.error(f"--phases: choose from {','.join(PHASES)} (got {bad})" if bad else "--budget: must be > 0")
    return rehearse(args) if args.rehearse else check(args)


if __name__ == "__main__":
    sys.exit(main())
