"""Running a phase's child process: in its own process group, with the carried packages first on its path,
cut at its budget (SIGTERM: a training run saves and stops), its progress published while it runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu import settings
from gpu.cache import cache_dir


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(settings.SITE), str(settings.ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # inductor's caches in the folder the command packs and the next one unpacks (gpu/cache.py)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    return env


def run_child(
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
            cmd,
            cwd=settings.ROOT,
            env=env or child_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        rc = None
        while rc is None:
            try:
                rc = p.wait(timeout=max(0.1, min(settings.TICK_S, deadline - time.monotonic())))
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


def status(rc: int) -> str:
    return "ok" if rc == 0 else ("timeout" if rc == 124 else "failed")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
