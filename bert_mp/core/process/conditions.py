"""The conditions a run was measured under: threads, processes, cores, load, CPU and GPU.

A speed figure means something only beside the conditions it was measured under, so every run
records them in ``summary.json`` (``conditions``) and the sweep report compares runs only where
they match. This module also picks the thread count when the user has not: ``cores // local
processes`` (at least 1), so that processes started side by side do not oversubscribe the cores.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from bert_mp.core.numerics.subnormal import subnormal_share, threads_flushing

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Environment variables that set the intra-op thread count; either one set means the user chose."""
LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "WORLD_SIZE")
"""Set by ``torchrun`` / ``accelerate launch``: processes started on this machine (then in all)."""


@dataclass
class ThreadChoice:
    """How many intra-op threads this process uses, and who decided."""

    threads: int
    source: str
    """``OMP_NUM_THREADS=1`` (the environment's), ``2 cores // 1 process`` (bert-mp's default), or
    ``set in this process`` (a caller of the Python API)."""


_CHOSEN: list[ThreadChoice] = []
"""What :func:`apply_default_threads` decided in this process (empty: it was not called)."""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def local_processes() -> int:
    """Processes of this run on this machine, as the launcher says (1 without a launcher)."""
    for key in LOCAL_SIZE_ENV:
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def thread_env() -> dict[str, str]:
    """The thread variables that are set (non-empty) in this process's environment."""
    return {k: os.environ[k] for k in THREAD_ENV if os.environ.get(k, "").strip()}


def default_threads(cores: int, processes: int) -> int:
    """``cores // processes``, at least 1: every process of a launch gets its share of the cores."""
    return max(1, cores // max(1, processes))


def apply_default_threads() -> ThreadChoice:
    """Unless ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` is set, use ``cores // local processes`` threads.

    Called by the command line before a training command starts; a Python caller keeps whatever
    it set with ``torch.set_num_threads``.
    """
    import torch

    env = thread_env()
    if env:
        key, value = next(iter(env.items()))
        choice = ThreadChoice(torch.get_num_threads(), f"{key}={value}")
    else:
        cores, procs = usable_cores(), local_processes()
        threads = default_threads(cores, procs)
        torch.set_num_threads(threads)
        choice = ThreadChoice(threads, f"{cores} cores // {procs} process{'es' if procs > 1 else ''}")
    _CHOSEN[:] = [choice]
    return choice


def current_threads() -> ThreadChoice:
    """This process's thread count and its source (the CLI's choice, or the caller's)."""
    import torch

    threads = torch.get_num_threads()
    if _CHOSEN and _CHOSEN[0].threads == threads:
        return _CHOSEN[0]
    env = thread_env()
    source = f"{next(iter(env))}={next(iter(env.values()))}" if env else "set in this process"
    return ThreadChoice(threads, source)


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cpu_model() -> str:
    """The CPU's marketing name (``model name`` of /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has used since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields_ = f.readline().split()[1:]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
    ticks = [int(x) for x in fields_[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its children (data workers), finished or still running."""
    import psutil

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return total
    for child in children:
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # ended meanwhile: counted by RUSAGE_CHILDREN once reaped
            continue
    return total


def gpu_conditions() -> dict[str, Any] | None:
    """SM clocks and the other processes on the GPUs, from ``nvidia-smi`` where it is installed
    (a few milliseconds; None without CUDA or without the tool)."""
    import torch

    if not torch.cuda.is_available():
        return None
    out: dict[str, Any] = {"name": torch.cuda.get_device_name()}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return out
    queries = {
        "clocks": [
            "--query-gpu=index,clocks.sm,clocks.max.sm,temperature.gpu,power.draw",
            "--format=csv,noheader",
        ],
        "processes": ["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
    }
    for key, args in queries.items():
        try:
            res = subprocess.run([smi, *args], capture_output=True, text=True, timeout=10, check=False)
            out[key] = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.SubprocessError):
            out[key] = None
    own = str(os.getpid())
    out["other_processes"] = [p for p in out.get("processes") or [] if p.split(",")[0].strip() != own]
    return out


@dataclass
class Conditions:
    """``summary.json``'s ``conditions`` block: what a run's speed was measured under."""

    threads: int
    """torch intra-op threads of each process."""
    threads_source: str
    interop_threads: int
    thread_env: dict[str, str]
    processes: int
    local_processes: int
    cores: int
    """Cores this process may run on (affinity)."""
    cpu_model: str
    load_start: list[float] | None
    """1/5/15-minute load averages when the run started (None where the system has none)."""
    load_end: list[float] | None = None
    others_cpu_cores: float | None = None
    """Cores used on average by other processes while the run ran (machine CPU time minus this run's
    own processes', over wall time; None where /proc/stat is missing)."""
    gpu: dict[str, Any] | None = None
    flush_denormal: str | None = None
    """Whether torch's CPU threads flush subnormal floats to zero (``hardware.flush_denormal``), as
    measured at the start: on, off or partial (:mod:`bert_mp.core.numerics.subnormal`)."""
    subnormal_share: float | None = None
    """Share of the fp32 / bf16 values of the weights and optimizer state that were subnormal at the
    end of the run (on a CPU each costs a slow path wherever it is read)."""
    _clock: dict[str, float] = field(default_factory=dict, repr=False)

    @classmethod
    def at_start(cls, processes: int) -> Conditions:
        import torch

        choice = current_threads()
        c = cls(
            threads=choice.threads,
            threads_source=choice.source,
            interop_threads=torch.get_num_interop_threads(),
            thread_env=thread_env(),
            processes=processes,
            local_processes=local_processes(),
            cores=usable_cores(),
            cpu_model=cpu_model(),
            load_start=load_average(),
            gpu=gpu_conditions(),
            flush_denormal=threads_flushing(),
        )
        c._clock = {"wall": time.monotonic(), "own": _own_cpu_s(), "machine": _machine_busy_s() or -1.0}
        return c

    def at_end(self, state: Iterable[Any] = ()) -> dict[str, Any]:
        """Add the load at the end, the other processes' share and the subnormal share of ``state``
        (the run's weights and optimizer state), and return the block to record."""
        self.load_end = load_average()
        self.subnormal_share = subnormal_share(state)
        busy = _machine_busy_s()
        if self._clock and busy is not None and self._clock["machine"] >= 0:
            wall = time.monotonic() - self._clock["wall"]
            # each local rank counts its own CPU time; the ranks are alike, so the run used about that many times it
            own = (_own_cpu_s() - self._clock["own"]) * self.local_processes
            if wall > 0:
                self.others_cpu_cores = round(max(0.0, (busy - self._clock["machine"] - own) / wall), 2)
        return self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_clock")
        return d


# --------------------------------------------------------------------------------------------------
# the start-up line
# --------------------------------------------------------------------------------------------------
def startup_line(
    command: str,
    *,
    strategy: str = "",
    processes: int,
    threads: ThreadChoice,
    accumulation: int,
    precision: str,
    device: str,
    flush_denormal: str | None = None,
) -> str:
    """The one line a training command starts with: processes, threads, accumulation, precision,
    device, the distributed strategy in force, and whether subnormal floats are flushed (said only
    where they are)."""
    procs = f"{processes} process{'es' if processes != 1 else ''}"
    device += f", strategy {strategy}" if strategy else ""  # the distributed strategy in force
    flushed = {"on": ", subnormals flushed to zero", "partial": ", subnormals flushed on some threads only"}
    return (
        f"bert-mp {command}: {procs} x {threads.threads} thread{'s' if threads.threads != 1 else ''} "
        f"({threads.source}), accumulation {accumulation}, precision {precision}, device {device}"
        + flushed.get(flush_denormal or "", "")
    )


LOAD_WARNING_ENV = "BERT_MP_LOAD_WARNING"
"""Set to 0 to turn the loaded-machine warning off (the test suite does: its exact-output checks must
not depend on how busy the machine is); the load is still recorded in summary.json."""


def load_warning(load: list[float] | None, cores: int, processes: int = 1, threads: int = 1) -> str | None:
    """A warning when the 1-minute load average is above the cores this run may use: other work
    shares them. ``processes`` x ``threads``: this run's own processes on this machine and the
    threads of each, named so the reader sees what the cores were compared with."""
    if not load or load[0] <= cores or os.environ.get(LOAD_WARNING_ENV) == "0":
        return None
    procs = f"{processes} process{'es' if processes != 1 else ''}"
    thr = f"{threads} thread{'s' if threads != 1 else ''}"
    return (
        f"the load average over the last minute is {load[0]:.2f}, above the {cores} cores this run may use "
        f"({procs} x {thr}): other work has been sharing the machine, so this run may be slower than the "
        "machine allows and its timings may not compare with an idle machine's (summary.json records the load "
        "it meets while it runs)"
    )


def device_label(device: Any) -> str:
    """``cpu (AMD EPYC 7B13)`` / ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({cpu_model()})"


def announce_start(
    accelerator: Any, command: str, accumulation: int, plan: Any, strategy: str = ""
) -> Conditions:
    """Record the conditions at the start of a run; on the main process print the start-up line (with
    ``strategy``, the distributed strategy in force) and warn when the machine is already loaded."""
    cond = Conditions.at_start(accelerator.num_processes)
    if accelerator.is_main_process:
        precision = plan.name + (" (emulated)" if getattr(plan, "emulated", False) else "")
        line = startup_line(
            command,
            strategy=strategy,
            processes=accelerator.num_processes,
            threads=ThreadChoice(cond.threads, cond.threads_source),
            accumulation=accumulation,
            precision=precision,
            device=device_label(accelerator.device),
            flush_denormal=cond.flush_denormal,
        )
        print(line, flush=True)
        warning = load_warning(cond.load_start, cond.cores, cond.local_processes, cond.threads)
        if warning:  # on stdout beside the start-up line: stderr stays the place for errors alone
            print(f"bert-mp {command}: warning: {warning}", flush=True)
    return cond
