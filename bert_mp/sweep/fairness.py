"""Whether two runs of a sweep were measured under the same conditions, so their speeds compare.

Each run's ``summary.json`` holds its ``conditions`` (:mod:`bert_mp.core.process.conditions`). A speed-up
is quoted only between runs whose threads, processes, CPU / GPU and machine load match: a run slowed
by another job (or by more threads than cores) would otherwise make every other precision look
faster than it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BUSY_SHARE = 0.25
"""A run counts as sharing the machine when other processes used more than this share of its cores
(and at least half a core) on average while it ran."""


def busy_limit(cores: int) -> float:
    return max(0.5, BUSY_SHARE * cores)


def is_busy(cond: dict[str, Any]) -> bool:
    """Other work shared the machine: measured while the run ran where possible, else the load at its start."""
    cores = int(cond.get("cores") or 1)
    others = cond.get("others_cpu_cores")
    if others is not None:
        return float(others) > busy_limit(cores)
    load = cond.get("load_start")
    return bool(load) and float(load[0]) > cores


def describe(cond: dict[str, Any] | None) -> str:
    """``2 threads x 1 process on 2 cores, load 0.4 -> 2.1, others 0.1 cores``."""
    if not cond:
        return "not recorded"
    load_start, load_end = cond.get("load_start"), cond.get("load_end")
    load = f"load {load_start[0]:.1f}" if load_start else "load n/a"
    if load_end:
        load += f" -> {load_end[0]:.1f}"
    others = cond.get("others_cpu_cores")
    return f"{cond['threads']} threads x {cond['processes']} process(es) on {cond['cores']} cores, {load}" + (
        f", others used {others:.1f} cores" if others is not None else ""
    )


def differences(ref: dict[str, Any] | None, cond: dict[str, Any] | None) -> list[str]:
    """What differs between the reference run's conditions and another run's (empty: they compare)."""
    if not ref and not cond:
        return []  # neither recorded them (written by an older bert_mp): nothing to compare
    if not ref or not cond:
        return ["conditions not recorded for " + ("the reference" if not ref else "this run")]
    out = []
    for key, what in (("threads", "threads"), ("processes", "processes"), ("cores", "cores")):
        if ref.get(key) != cond.get(key):
            out.append(f"{what} {cond.get(key)} vs {ref.get(key)}")
    if ref.get("cpu_model") != cond.get("cpu_model"):
        out.append(f"CPU {cond.get('cpu_model')} vs {ref.get('cpu_model')}")
    gpu_a, gpu_b = (ref.get("gpu") or {}).get("name"), (cond.get("gpu") or {}).get("name")
    if gpu_a != gpu_b:
        out.append(f"GPU {gpu_b} vs {gpu_a}")
    flush_a, flush_b = ref.get("flush_denormal"), cond.get("flush_denormal")
    if flush_a != flush_b and None not in (flush_a, flush_b):
        out.append(f"subnormals flushed {flush_b} vs {flush_a}")
    busy_ref, busy = is_busy(ref), is_busy(cond)
    if busy_ref != busy:
        loaded = "this run" if busy else "the reference"
        out.append(f"other work loaded the machine during {loaded} only")
    elif busy and _load_gap(ref, cond) > busy_limit(int(cond.get("cores") or 1)):
        out.append("both ran beside other work, of different amounts")
    return out


def _load_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    oa, ob = a.get("others_cpu_cores"), b.get("others_cpu_cores")
    if oa is not None and ob is not None:
        return abs(float(oa) - float(ob))
    la, lb = a.get("load_start"), b.get("load_start")
    return abs(float(la[0]) - float(lb[0])) if la and lb else 0.0


def unequal_runs(runs: Sequence[tuple[str, dict[str, Any] | None]], reference: str) -> dict[str, str]:
    """``run name -> what differs from the reference`` for each run whose speed does not compare."""
    conds = dict(runs)
    if reference not in conds:
        return {}
    ref = conds[reference]
    out = {}
    for name, cond in runs:
        if name != reference:
            diff = differences(ref, cond)
            if diff:
                out[name] = "; ".join(diff)
    return out


def withhold_speedups(ladder: list[dict[str, Any]], unequal: dict[str, str]) -> list[dict[str, Any]]:
    """The speed ladder with no speed-up quoted for runs measured under other conditions than the
    reference (``conditions_differ`` says why)."""
    for row in ladder:
        if row["name"] in unequal:
            row["speedup_vs_fp32"] = None
            row["conditions_differ"] = unequal[row["name"]]
    return ladder


def rerun_hint(sweep_file: str | None, names: Sequence[str]) -> str:
    """The command that measures ``names`` again, with nothing else running."""
    recipe = sweep_file or "<the sweep recipe>"
    return (
        f"`bert-mp sweep {recipe} sweep.rerun=[{','.join(names)}]` (with the overrides the sweep was "
        "started with), on an otherwise idle machine and with the same OMP_NUM_THREADS for every run"
    )
