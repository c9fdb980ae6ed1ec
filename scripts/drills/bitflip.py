"""Bit-flip drill: damage the newest checkpoint of a finished run, resume, and compare bit for bit.

An uninterrupted fp32 run of a tiny model is the reference (the kill drill's run: 24 steps,
``save_every=4``, dropout on, gradient accumulation, an evaluation every 8 steps, export). Each
trial copies it, drops its ``final/`` export, XORs one byte at a seeded random offset of a seeded
random file of its newest checkpoint (``step_00000024``: model, optimizer, scheduler, RNG, loop
state or the ``COMPLETE`` manifest itself) with a random non-zero mask, and resumes it with
``train.resume=latest`` through the real CLI. A trial passes when the flip is

- detected: the resume warns, in one line, that it skipped ``step_00000024`` and why (the file
  whose checksum or size no longer matches, or the unreadable manifest),
- resumed from the previous checkpoint (``step_00000020``), and
- identical: the per-step log (every deterministic field of metrics.jsonl, train and eval rows)
  and the re-exported final weights equal the reference exactly.

    python scripts/drills/bitflip.py --trials 20 --out docs/benchmarks/bitflip_drill_cpu.json
    python scripts/drills/bitflip.py --prepared DIR --trials 5

Without ``--prepared`` the data comes from ``bert-mp prepare`` (tiny built-in corpus); see
scripts/drills/fault.py, whose run configuration, process runner and comparison this reuses.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.harness import write_report  # noqa: E402

from bert_mp.core.checkpoint import store as ckpt  # noqa: E402
from drills import fault as kill  # noqa: E402 (the kill drill's helpers)


@dataclass
class FlipSpec:
    """The drilled run and the flips."""

    trials: int = 20
    seed: int = 0
    """Seed of the file, offset and mask choices (the training seed is fixed by the config)."""
    max_steps: int = 24
    save_every: int = 4
    precision: str = "fp32"


@dataclass
class FlipRecord:
    """One trial: what was flipped and what the resume made of it."""

    trial: int
    file: str
    offset: int
    size: int
    mask: int
    found_before_load: str | None = None
    """What ``checkpoint.verify`` says of the flipped folder (None: the flip went unnoticed)."""
    warning: str | None = None
    """The resume's one-line warning about the skipped checkpoint."""
    warnings: int = 0
    """How many times the resume warned about it (once)."""
    resumed_from: str | None = None
    detected: bool = False
    resumed_previous: bool = False
    identical: bool = False
    problems: list[str] | None = None


def flip_byte(folder: Path, rng: random.Random, trial: int) -> FlipRecord:
    """XOR one random byte of one random file of ``folder`` with a random non-zero mask."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    offset, mask = rng.randrange(len(data)), rng.randrange(1, 256)
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    return FlipRecord(trial, path.relative_to(folder).as_posix(), offset, len(data), mask)


_SKIPPED = re.compile(r"[Ww]arning: skipping checkpoint (\S+): (.+)$")


def run_trial(
    runner: kill.Runner,
    reference: Path,
    out: Path,
    spec: FlipSpec,
    data_cache: Path,
    rng: random.Random,
    trial: int,
) -> FlipRecord:
    """Copy the reference, flip a byte of its newest checkpoint, resume, compare."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(reference, out)
    shutil.rmtree(out / "final")  # the resume must make it again for the comparison to mean anything
    newest = ckpt.list_checkpoints(out / "checkpoints")[-1]
    previous = ckpt.checkpoint_name(spec.max_steps - spec.save_every)
    rec = flip_byte(newest, rng, trial)
    rec.found_before_load = ckpt.verify(newest)
    log = out.with_suffix(".log")
    log.unlink(missing_ok=True)
    cfg = kill.drill_config(
        out,
        kill.DrillSpec(max_steps=spec.max_steps, save_every=spec.save_every, precision=spec.precision),
        data_cache,
    )
    runner.run(kill.write_run_config(cfg, resume=True), log)
    skipped = [m for m in map(_SKIPPED.search, log.read_text(errors="replace").splitlines()) if m]
    about = [m.group(0) for m in skipped if m.group(1).endswith(newest.name)]
    rec.warning, rec.warnings = (about[0] if about else None), len(about)
    rec.resumed_from = json.loads((out / "summary.json").read_text())["resumed_from"]
    rec.detected = rec.warnings == 1
    rec.resumed_previous = bool(rec.resumed_from) and rec.resumed_from.endswith(previous)
    rec.problems = kill.compare(reference, out)
    rec.identical = not rec.problems
    return rec


def run_drill(workdir: Path, spec: FlipSpec, prepared: Path | None = None) -> dict:
    """The reference run, then ``spec.trials`` flips; returns the report."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    runner = kill.Runner(prepared)
    data_cache = workdir / "data"
    kspec = kill.DrillSpec(max_steps=spec.max_steps, save_every=spec.save_every, precision=spec.precision)
    if prepared is None:
        kill.prepare_builtin(
            kill.drill_config(workdir / "prepare", kspec, data_cache), workdir / "prepare.log"
        )
    reference = workdir / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    started = time.perf_counter()
    runner.run(
        kill.write_run_config(kill.drill_config(reference, kspec, data_cache), resume=False),
        workdir / "reference.log",
    )
    reference_s = time.perf_counter() - started
    rng = random.Random(spec.seed)
    records = []
    for trial in range(spec.trials):
        rec = run_trial(runner, reference, workdir / f"trial_{trial:02d}", spec, data_cache, rng, trial)
        records.append(rec)
        print(_row(rec), flush=True)
    return summarize(spec, records, reference_s)


def summarize(spec: FlipSpec, records: list[FlipRecord], reference_s: float) -> dict:
    by_file: dict[str, int] = {}
    for r in records:
        by_file[r.file] = by_file.get(r.file, 0) + 1
    return {
        "spec": asdict(spec),
        "reference_seconds": round(reference_s, 2),
        "trials": len(records),
        "found_before_load": sum(r.found_before_load is not None for r in records),
        "detected": sum(r.detected for r in records),
        "resumed_previous": sum(r.resumed_previous for r in records),
        "identical": sum(r.identical for r in records),
        "files_flipped": dict(sorted(by_file.items())),
        "trial_results": [asdict(r) for r in records],
    }


def _row(r: FlipRecord) -> str:
    return (
        f"{r.trial:>5} {r.file:>28} {r.offset:>8}/{r.size:<8} 0x{r.mask:02x} "
        f"{'yes' if r.detected else 'NO':>8} {'yes' if r.resumed_previous else 'NO':>7} "
        f"{'yes' if r.identical else 'NO':>9}  {r.found_before_load}"
    )


def print_report(report: dict) -> None:
    print(
        f"{'trial':>5} {'file':>28} {'offset/size':>17} mask {'detected':>8} {'resumed':>7} {'identical':>9}  reason"
    )
    for r in report["trial_results"]:
        print(_row(FlipRecord(**r)))
    print(
        f"\ntrials {report['trials']}: detected {report['detected']}, resumed from the previous checkpoint "
        f"{report['resumed_previous']}, bit-identical to the uninterrupted run {report['identical']}"
    )
    for r in report["trial_results"]:
        for p in r["problems"] or []:
            print(f"trial {r['trial']}: {p}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/bitflip_drill"))
    p.add_argument(
        "--prepared", type=Path, help="prepared-data folder (default: bert-mp prepare, built-in corpus)"
    )
    p.add_argument("--trials", type=int, default=FlipSpec.trials)
    p.add_argument("--seed", type=int, default=FlipSpec.seed)
    p.add_argument("--precision", default=FlipSpec.precision, choices=("fp32", "tf32", "bf16", "fp16"))
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    args = p.parse_args(argv)
    spec = FlipSpec(trials=args.trials, seed=args.seed, precision=args.precision)
    report = run_drill(args.workdir, spec, args.prepared)
    print_report(report)
    if args.out:
        write_report(report, args.out)
    n = report["trials"]
    return 0 if report["detected"] == report["resumed_previous"] == report["identical"] == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
