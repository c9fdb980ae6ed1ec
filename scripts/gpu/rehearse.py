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
            got = sorted(x.name for x in cmd_out.iterdir()) if cmd_out.exists() else []
            want = [f"{n}.json" for n in ("install", *phases)] + [
                "summary.json",
                "summary.md",
                settings.LOG_NAME,
            ]
            missing = [w for w in want if w not in got]
            statuses = {
                n: (read_json(cmd_out / f"{n}.json") or {}).get("status") for n in ("install", *phases)
            }
            phase_s = {
                n: (read_json(cmd_out / f"{n}.json") or {}).get("seconds") for n in ("install", *phases)
            }
            ok = proc.returncode == 0 and not missing and len(got) <= settings.MAX_OUT_FILES
            carried = cmd_out / ARCHIVE if ARCHIVE in got else carried
            record["commands"].append(
                {
                    "command": " ".join(["bash scripts/gpu_check.sh $OUT", *phases]),
                    "rc": proc.returncode,
                    "seconds": seconds,
                    "cpu_s": cpu_s,
                    "phase_seconds": phase_s,
                    "statuses": statuses,
                    "cache": ((read_json(cmd_out / "summary.json") or {}).get("inductor_cache")),
                    "files": got,
                    "missing": missing,
                    "ok": ok,
                }
            )
            record["ok"] &= ok
            print(
                f"[rehearse] command {i}: {' '.join(phases)}: rc {proc.returncode}, {seconds} s ({cpu_s} CPU s), {statuses}"
                + (f", MISSING {missing}" if missing else ""),
                flush=True,
            )
            if not ok:
                print(proc.stdout[-3000:] + proc.stderr[-3000:])
    (out / "rehearsal.json").write_text(json.dumps(record, indent=1))
    print(f"[rehearse] {'ok' if record['ok'] else 'FAILED'}: {out / 'rehearsal.json'}")
    return 0 if record["ok"] else 1
