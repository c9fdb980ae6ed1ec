"""The CPU rehearsal of the GPU sequence (CI runs it: tests/integration/test_gpu_check_rehearsal.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu import settings
from gpu.cache import ARCHIVE
from gpu.child import clean_env, read_json


def _repository_files() -> list[str]:
    """What a fresh clone holds (tracked and new files), or the tree without local state."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=settings.ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".gpu_site", ".wheels", "runs", "__pycache__"}
        return [
            str(p.relative_to(settings.ROOT))
            for p in settings.ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(settings.ROOT).parts)
        ]


def _children_cpu() -> float:
    """CPU seconds (user + system) of every finished child process so far: a command's cost on any machine
    is the difference around it (wall time also counts what else the machine runs)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def produced(summary: dict[str, Any], phase: str) -> int:
    """How much ``phase`` measured, from summary.json (settings.ROWS): its rows; tests run; runs that
    trained a step; BERT-large's speeds measured and its parity verdict."""
    rows = summary.get(settings.ROWS[phase]) or {}
    if phase == "tests":
        return sum(rows.values())
    if phase == "sweep":
        return sum(1 for run in rows.values() if run.get("steps"))
    if phase == "large":
        speeds = [r for r in (rows.get("speed") or {}).values() if r.get("tokens_per_sec")]
        return len(speeds) + bool(rows.get("fp8_parity"))
    return len(rows)


def judge(cmd_out: Path, phases: tuple[str, ...] | list[str], rc: int) -> dict[str, Any]:
    """One command's verdict from what it left in ``cmd_out``: its files (none missing, at most
    settings.MAX_OUT_FILES), each phase's status, seconds and rows, the inductor cache, and the phases
    that hung: cut at their budget (``timeout``) with nothing measured. A slow machine's cut after rows
    is a timeout with rows: the command is not ok (rc 1), and not hung."""
    got = sorted(x.name for x in cmd_out.iterdir()) if cmd_out.exists() else []
    want = [f"{n}.json" for n in ("install", *phases)] + ["summary.json", "summary.md", settings.LOG_NAME]
    results = {n: read_json(cmd_out / f"{n}.json") or {} for n in ("install", *phases)}
    statuses = {n: r.get("status") for n, r in results.items()}
    summary = read_json(cmd_out / "summary.json") or {}
    rows = {n: produced(summary, n) for n in phases}
    hung = [n for n in phases if statuses[n] == "timeout" and not rows[n]]
    missing = [w for w in want if w not in got]
    return {
        "phase_seconds": {n: r.get("seconds") for n, r in results.items()},
        "statuses": statuses,
        "rows": rows,
        "hung": hung,
        "cache": summary.get("inductor_cache"),
        "files": got,
        "missing": missing,
        "ok": rc == 0 and not missing and not hung and len(got) <= settings.MAX_OUT_FILES,
    }


def rehearse(out: Path) -> int:
    """Run settings.COMMANDS as docs/gpu.md gives them, with ``--dry-run``, each as on a fresh machine.

    A copy of the repository's tracked files stands in for the machine; ``.gpu_site/`` and
    ``runs/`` are deleted before each command, every command gets its own OUT folder, and each
    must leave its phase files, the summary and the log (at most settings.MAX_OUT_FILES files). The
    inductor-cache archive a command leaves in its OUT is carried into the next one, as ``carry``
    would (gpu/cache.py).
    """
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    files = _repository_files()
    record: dict[str, Any] = {"commands": [], "ok": True}
    with tempfile.TemporaryDirectory(prefix="gpu_rehearsal_") as tmp:
        machine = Path(tmp) / "repo"
        for f in files:
            src = settings.ROOT / f
            if src.is_file():
                (machine / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, machine / f)
        carried = None
        for i, phases in enumerate(settings.COMMANDS, 1):
            shutil.rmtree(machine / ".gpu_site", ignore_errors=True)  # a fresh machine each command
            shutil.rmtree(machine / "runs", ignore_errors=True)
            shutil.rmtree(machine / settings.CARRIED_DIR, ignore_errors=True)
            if carried is not None:  # what the previous command packed, carried in
                (machine / settings.CARRIED_DIR).mkdir()
                shutil.copy2(carried, machine / settings.CARRIED_DIR / ARCHIVE)
            cmd_out = out / f"command_{i}"
            shutil.rmtree(cmd_out, ignore_errors=True)
            argv = ["bash", "scripts/gpu_check.sh", str(cmd_out), *phases, "--dry-run"]
            t, cpu = time.monotonic(), _children_cpu()
            env = {**clean_env(), "PYTHON": sys.executable}
            proc = subprocess.run(argv, cwd=machine, capture_output=True, text=True, env=env)
            seconds, cpu_s = round(time.monotonic() - t, 1), round(_children_cpu() - cpu, 1)
            judged = judge(cmd_out, phases, proc.returncode)
            ok, got = judged["ok"], judged["files"]
            carried = cmd_out / ARCHIVE if ARCHIVE in got else carried
            record["commands"].append(
                {
                    "command": " ".join(["bash scripts/gpu_check.sh $OUT", *phases]),
                    "rc": proc.returncode,
                    "seconds": seconds,
                    "cpu_s": cpu_s,
                    **judged,
                }
            )
            record["ok"] &= ok
            missing, hung = judged["missing"], judged["hung"]
            print(
                f"[rehearse] command {i}: {' '.join(phases)}: rc {proc.returncode}, {seconds} s ({cpu_s} CPU s), "
                f"{judged['statuses']}, rows {judged['rows']}"
                + (f", MISSING {missing}" if missing else "")
                + (f", HUNG {hung} (cut at the budget with nothing measured)" if hung else ""),
                flush=True,
            )
            if not ok:
                print(proc.stdout[-3000:] + proc.stderr[-3000:])
    (out / "rehearsal.json").write_text(json.dumps(record, indent=1))
    print(f"[rehearse] {'ok' if record['ok'] else 'FAILED'}: {out / 'rehearsal.json'}")
    return 0 if record["ok"] else 1
