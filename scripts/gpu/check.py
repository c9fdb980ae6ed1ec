"""Validate bert_mp on a bare GPU machine: phases that each fit a lent machine's command.

    bash scripts/gpu_check.sh OUT_DIR [PHASE ...] [--dry-run] [--force] [--budget PHASE=S]
    bash scripts/gpu_check.sh OUT_DIR --rehearse      # the docs/gpu.md sequence on this CPU

(``python -m gpu.check`` with ``scripts/`` on ``PYTHONPATH``, which the shell script sets.)

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
(scripts/bench/profile_step.py: bf16 padded / unpadded / unpadded + compiled, each kernel's device time
over the timed steps, grouped: GEMM, attention, LayerNorm, copies ...), ``compile``
(the ladder with ``train.compile=model``), ``sweep`` (configs/sweep_gpu_short.yaml: BERT-base,
200 steps per precision plus the second fp32 seed, parity verdicts, on a docstring corpus built
in seconds; ``--long-sweep`` for configs/sweep_gpu_base.yaml), ``summary``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gpu import settings
from gpu.cache import ARCHIVE, pack, unpack_carried
from gpu.child import read_json
from gpu.cuda_tests import phase_tests
from gpu.install import phase_install
from gpu.kernels import phase_kernels
from gpu.ladder import phase_compile, phase_ladder, phase_paths
from gpu.levers import phase_large, phase_levers
from gpu.profiling import phase_profile
from gpu.rehearse import rehearse
from gpu.summary import build_summary, summary_markdown
from gpu.sweep import phase_sweep

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
# what goes back: at most settings.MAX_OUT_FILES files, rewritten whenever something new is known
# --------------------------------------------------------------------------------------------------
class Publisher:
    """Writes this command's phase files, the summary and the log into OUT_DIR (again and again)."""

    def __init__(self, out: Path, phases: list[str]):
        self.out, self.phases, self.lines = out, phases, []
        self.last = 0.0
        self.cache: dict[str, Any] = {}
        """Inductor's cache: what was carried in, what was packed for the next command (gpu/cache.py)."""
        out.mkdir(parents=True, exist_ok=True)

    def pack_cache(self) -> None:
        """Inductor's cache into OUT as one archive for the next command (after each phase: a command
        cut later keeps what its finished phases compiled and tuned)."""
        self.cache["packed"] = pack(self.out)

    def say(self, line: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S', time.gmtime())}] {line}"
        print(line, flush=True)
        self.lines.append(line)

    def phase_file(self, name: str, res: dict[str, Any]) -> None:
        (settings.STATE / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))

    def progress(self, name: str, partial: dict[str, Any]) -> None:
        """A running phase's partial results, published at most every settings.TICK_S seconds."""
        if time.monotonic() - self.last < settings.TICK_S:
            return
        self.phase_file(name, {"status": "running", "phase": name, **partial})
        self.publish()

    def publish(self) -> None:
        self.last = time.monotonic()
        loaded = {n: read_json(settings.STATE / f"{n}.json") for n in settings.PHASES if n != "summary"}
        summary = build_summary(loaded, cache=self.cache)
        (settings.STATE / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        (settings.STATE / "summary.md").write_text(summary_markdown(summary))
        names = [n for n in settings.PHASES if n != "summary" and loaded.get(n) is not None]
        mine = [n for n in names if n in self.phases] or names  # `summary` alone: whatever is there
        files = [settings.STATE / f"{n}.json" for n in mine] + [
            settings.STATE / "summary.json",
            settings.STATE / "summary.md",
        ]
        room = settings.MAX_OUT_FILES - 1 - (self.out / ARCHIVE).exists()  # the log, the cache archive
        if len(files) > room:  # install's facts are in summary.json too
            files = [f for f in files if f.name != "install.json"][:room]
        for f in files:
            tmp = self.out / (f.name + ".tmp")
            shutil.copy(f, tmp)
            tmp.replace(self.out / f.name)
        (self.out / settings.LOG_NAME).write_text(self.log_text(loaded))

    def log_text(self, loaded: dict[str, Any]) -> str:
        """The command's own lines, then per phase of this command: the full text of each failing
        test, and the child's whole log (capped) where the phase did not end ok."""
        parts = ["\n".join(self.lines)]
        for name in self.phases:
            res = loaded.get(name) or {}
            for test, text in (res.get("failures") or {}).items():
                parts.append(f"\n===== FAILED {test} =====\n{text}")
            bench = ("ladder", "compile", "paths", "levers", "large")
            child = settings.STATE / f"{'bench_' + name if name in bench else name}.log"
            if res.get("status") not in (None, "ok", "running") and child.exists():
                text = child.read_text(errors="replace")
                parts.append(
                    f"\n===== {name}: {res.get('status')}, {child.name} =====\n{text[-settings.LOG_CAP :]}"
                )
        return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument(
        "phases",
        nargs="*",
        help=f"{', '.join(settings.PHASES)} (default: {' '.join(settings.DEFAULT_PHASES)})",
    )
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
    p.add_argument(
        "--deadline", type=float, default=settings.DEADLINE_S, help="seconds for the whole command"
    )
    p.add_argument("--test-timeout", type=float, default=None, help="seconds per test (tests phase)")
    p.add_argument(
        "--long-sweep", action="store_true", help="configs/sweep_gpu_base.yaml (1000 steps, resumes)"
    )
    p.add_argument(
        "--wheels", default=str(settings.WHEELS), help="folder of carried wheels (default .wheels)"
    )
    p.add_argument("--micro-batch", type=int, default=256, help="ladder micro-batch (BERT-base, seq 128)")
    args = p.parse_args(argv)
    if args.rehearse:
        return rehearse(Path(args.out_dir))
    phases = list(args.phases or settings.DEFAULT_PHASES)
    bad = [x for x in phases if x not in settings.PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {', '.join(settings.PHASES)}")
    if (
        phases != ["summary"]
        and "install" not in phases
        and not (settings.SITE / settings.INSTALLED).exists()
    ):
        phases.insert(0, "install")  # a fresh machine: every command installs what it needs
    if len([x for x in phases if x != "summary"]) > settings.MAX_OUT_FILES - 4:
        p.error(
            f"at most {settings.MAX_OUT_FILES - 4} phases per command (at most {settings.MAX_OUT_FILES} files "
            "come back: the phases', the summary's two, the log and the cache archive)"
        )
    budgets = dict(settings.BUDGETS_DRY if args.dry_run else settings.BUDGETS)
    for item in args.budget:
        name, _, sec = item.partition("=")
        budgets[name] = float(sec)
    args.test_timeout = args.test_timeout or (60.0 if args.dry_run else 120.0)
    settings.STATE.mkdir(parents=True, exist_ok=True)
    pub = Publisher(Path(args.out_dir), phases)
    pub.cache["carried_in"] = unpack_carried()
    if pub.cache["carried_in"]["carried"]:
        pub.say(f"inductor cache carried in: {pub.cache['carried_in']['files']} files")
    started = time.monotonic()
    ran = []
    for name in phases:
        if name == "summary":
            continue
        left = args.deadline - (time.monotonic() - started) - settings.RESERVE_S
        args.budget = min(budgets[name], left)
        path = settings.STATE / f"{name}.json"
        if path.exists() and not args.force and (read_json(path) or {}).get("status") == "ok":
            pub.say(f"{name}: done before on this machine (use --force to rerun)")
            continue
        if left < settings.MIN_PHASE_S:
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
        pub.pack_cache()
        pub.publish()
    pub.say(f"done in {time.monotonic() - started:.0f} s; files in {args.out_dir}")
    pub.publish()
    print((settings.STATE / "summary.md").read_text())
    failed = [n for n in ran if (read_json(settings.STATE / f"{n}.json") or {}).get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
