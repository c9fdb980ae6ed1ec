"""Launch drill: distributed faults on the quickstart recipe, through the real ``bert-mp launch``.

One 2-process run (``configs/quickstart.yaml``, ``train.micro_batch_size=16``, a checkpoint every 10
steps), acted on at held points (``BERT_MP_HOLD``), never by timing:

1. held after step ``--rank-kill-step``: a second ``bert-mp train ... train.resume=latest`` into the
   same folder (its exit code and line), then rank 1 SIGKILLed (as the out-of-memory killer does):
   the launch's exit code, its stderr, the seconds from the kill to its end;
2. the command that line gives, held after step ``--launcher-kill-step``: ``bert-mp launch`` itself
   SIGKILLed; the seconds until its launcher and ranks have all ended, the stop recorded;
3. the same command again, to the end.

    python scripts/drills/launch_faults.py --out docs/benchmarks/launch_faults_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.harness import machine_record, write_report  # noqa: E402

from bert_mp.core.process import hold  # noqa: E402
from drills.fault import child_env, wait_held  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _start(argv: list[str], cwd: Path, point: str | None = None) -> tuple[subprocess.Popen, Path]:
    ready = cwd / "held"
    ready.unlink(missing_ok=True)
    env = {**child_env(), **({hold.HOLD_ENV: point, hold.READY_ENV: str(ready)} if point else {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bert_mp", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    if point and not wait_held(proc, ready):
        raise RuntimeError(f"exited before {point}: {proc.communicate()}")
    return proc, ready


def _ranks(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    found = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        rank = p.environ().get("RANK")
        if rank is not None and "bert_mp" in " ".join(p.cmdline()):
            found[int(rank)] = p
    return found


def kill_a_rank(work: Path, train: list[str], step: int, port: str) -> dict:
    """Phase 1: a second train into the held run, then rank 1 SIGKILLed."""
    launch = ["launch", "--num_processes", "2", "--main_process_port", port, "train", *train]
    proc, ready = _start(launch, work, f"step:{step}")
    second = subprocess.run(
        [sys.executable, "-m", "bert_mp", "train", *train, "train.resume=latest"],
        cwd=work, env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    victim = _ranks(proc)[1]
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    ready.unlink()
    _, err = proc.communicate(timeout=600)
    return {
        "second_train": {"exit_code": second.returncode, "stderr": second.stderr.splitlines()},
        "rank_killed": {"rank": 1, "pid": victim.pid, "held_after_step": step},
        "exit_code": proc.returncode,
        "seconds_to_end": round(time.monotonic() - t0, 1),
        "stderr_lines": len(err.splitlines()),
        "last_line": err.strip().splitlines()[-1],
    }


def kill_the_launcher(work: Path, command: list[str], step: int, out: str) -> dict:
    """Phase 2: the continue command, held; bert-mp launch SIGKILLed; its processes' end."""
    proc, ready = _start(command, work, f"step:{step}")
    others = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    t0 = time.monotonic()
    ready.unlink()
    _, alive = psutil.wait_procs(others, timeout=600)
    seconds = round(time.monotonic() - t0, 1)
    stdout, _ = proc.communicate(timeout=60)
    summary = json.loads((work / out / "summary.json").read_text())
    return {
        "held_after_step": step,
        "processes_left_behind": len(others),
        "seconds_until_all_ended": seconds,
        "still_running": [p.pid for p in alive],
        "summary": {k: summary[k] for k in ("status", "stop_reason", "steps")},
        "stopped_line": [ln for ln in stdout.splitlines() if "stopped after" in ln],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank-kill-step", type=int, default=25)
    p.add_argument("--launcher-kill-step", type=int, default=35)
    p.add_argument("--port", default="29731")
    p.add_argument("--out", default="runs/launch_faults.json")
    args = p.parse_args(argv)
    out = "runs/x"
    train = [RECIPE.name, "train.micro_batch_size=16", "train.save_every=10", f"train.output_dir={out}"]
    train.append("train.progress_bar=false")
    report: dict = {"machine": machine_record(), "recipe": train}
    with tempfile.TemporaryDirectory(prefix="bert-mp-launch-drill-") as tmp:
        work = Path(tmp)
        shutil.copy(RECIPE, work / RECIPE.name)  # the commands name it as a user in that folder would
        report["rank_kill"] = kill_a_rank(work, train, args.rank_kill_step, args.port)
        write_report(report, args.out)  # each phase the moment it is measured
        line = report["rank_kill"]["last_line"]
        command = shlex.split(line.split("continue the run with `")[1].split("`")[0])[1:]
        report["launcher_kill"] = kill_the_launcher(work, command, args.launcher_kill_step, out)
        write_report(report, args.out)
        done = subprocess.run(
            [sys.executable, "-m", "bert_mp", *command],
            cwd=work,
            env=child_env(),
            capture_output=True,
            text=True,
        )
        summary = json.loads((work / out / "summary.json").read_text())
        report["finish"] = {
            "exit_code": done.returncode,
            "status": summary["status"],
            "steps": summary["steps"],
        }
        report["launch_log_lines"] = len((work / out / "launch.log").read_text().splitlines())
        write_report(report, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
