"""What content checksums cost a checkpoint: seconds per save with and without hashing, same run.

One process builds the preset's ``BertForPreTraining`` (``--preset base`` by default: BERT-base,
110 M parameters) with bert_mp's AdamW groups and schedule, takes one optimizer step so the Adam
moments exist, and then saves the same state ``--repeat`` rounds, each round measuring back to back

- ``hashed``: ``bert_mp.core.checkpoint.store.save_checkpoint`` as training calls it (the state streamed
  through xxh3-128 while written, every file fsynced, the manifest, the rename);
- ``unhashed``: the very same save with the hasher replaced by one that does nothing (the baseline
  the checksum cost is measured against);
- ``accelerate``: ``accelerator.save_state`` plus a size-only marker, how checkpoints were written
  before (pickle for everything but the weights, no fsync of the files);
- ``verify``: reading the saved checkpoint back and comparing every digest (what a resume adds
  before it loads; the files are in the page cache, as right after a save).

Each save goes to a fresh folder that is deleted afterwards; one untimed save per arm warms up
first, and the order of the arms rotates per round. Reported, in wall seconds and in CPU seconds of
the process (steadier on a shared machine): the median per arm, the checksum cost (the median of
the per-round differences hashed - unhashed, and the ratio of the medians) and the read-and-hash
throughput of ``verify``. Prints a table and writes JSON.

    python scripts/bench/checkpoint.py --preset base --repeat 5 --out docs/benchmarks/checkpoint_checksum_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bert_mp.core.process.noise import quiet_libraries  # noqa: E402

quiet_libraries()  # the libraries' chatter off the console, before they load, as `bert-mp` does

import torch  # noqa: E402

from bench.harness import write_report  # noqa: E402


class _NoHash:
    """A stand-in hasher: the ``unhashed`` arm writes exactly the same bytes without digesting them."""

    def update(self, data) -> None:  # noqa: ANN001
        pass

    def hexdigest(self) -> str:
        return "0" * 32


@contextmanager
def _unhashed():
    from bert_mp.core.storage import checksums as integrity

    real = integrity.new_hasher
    integrity.new_hasher = _NoHash
    try:
        yield
    finally:
        integrity.new_hasher = real


def build_state(preset: str, vocab: int):
    """An accelerator with the preset's model, AdamW after one step, and the schedule registered."""
    from accelerate import Accelerator

    from bert_mp.core.config import ModelConfig, TrainConfig
    from bert_mp.core.numerics.optimizers import build_optimizer, build_scheduler
    from bert_mp.model.bert import PretrainingModel, build_model

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = PretrainingModel(build_model(ModelConfig(preset=preset), vocab, vocab, 128))
    tc = TrainConfig(max_steps=100, warmup_steps=10)
    optimizer = build_optimizer(model, tc, acc.device)
    scheduler = build_scheduler(optimizer, tc)
    model, optimizer = acc.prepare(model, optimizer)
    acc.register_for_checkpointing(scheduler)
    for p in model.parameters():  # one step with random gradients: the Adam moments exist
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return acc, model


def _save_bert_mp(acc, root: Path, step: int) -> Path:
    from bert_mp.core.checkpoint import store as ckpt

    return ckpt.save_checkpoint(acc, root, step, {"step": step, "epoch": 0, "batch_in_epoch": step}, 100)


def _save_accelerate(acc, root: Path, step: int) -> Path:
    from bert_mp.core.storage.files import atomic_write_json

    folder = root / f"step_{step:08d}"
    acc.save_state(str(folder))
    atomic_write_json(folder / "loop_state.json", {"step": step})
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    atomic_write_json(folder / "COMPLETE", {"files": sizes})
    return folder


def _timed(fn, *args) -> tuple[tuple[float, float], object]:  # noqa: ANN001
    """``((wall seconds, CPU seconds of this process), result)``: on a shared machine the CPU time is
    the steadier measure of the work itself, the wall time includes waiting for the disk and the CPU."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    return (time.perf_counter() - t0, time.process_time() - c0), out


def measure(acc, workdir: Path, repeat: int) -> dict:
    """Seconds per arm and round (after an untimed warm-up round); checkpoint size."""
    from bert_mp.core.storage import checksums as integrity
    from bert_mp.core.storage import disk as storage

    arms = ["hashed", "unhashed", "accelerate"]
    seconds: dict[str, list[float]] = {a: [] for a in [*arms, "verify"]}
    cpu: dict[str, list[float]] = {a: [] for a in [*arms, "verify"]}
    sizes: dict[str, int] = {}
    step = 0
    for r in range(-1, repeat):  # round -1: warm-up, not recorded
        for arm in arms[r % 3 :] + arms[: r % 3]:
            step += 1
            root = workdir / arm
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            if arm == "hashed":
                dt, folder = _timed(_save_bert_mp, acc, root, step)
            elif arm == "unhashed":
                with _unhashed():
                    dt, folder = _timed(_save_bert_mp, acc, root, step)
            else:
                dt, folder = _timed(_save_accelerate, acc, root, step)
            sizes[arm] = storage.folder_bytes(folder)
            if r < 0:
                shutil.rmtree(root)
                continue
            seconds[arm].append(dt[0])
            cpu[arm].append(dt[1])
            if arm == "hashed":
                integrity._MEMO.clear()  # the check reads and hashes every file again
                dv, verdict = _timed(integrity.check, folder, "COMPLETE", "no marker")
                assert verdict.problem is None, verdict.problem
                seconds["verify"].append(dv[0])
                cpu["verify"].append(dv[1])
            shutil.rmtree(root)
            print(f"round {r + 1} {arm:>10}: {dt[0]:.3f} s ({dt[1]:.3f} CPU s)", flush=True)
    return {"seconds": seconds, "cpu_seconds": cpu, "bytes": sizes}


def _paired_cost(series: dict[str, list[float]]) -> float:
    return round(statistics.median(h - u for h, u in zip(series["hashed"], series["unhashed"])), 4)


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    med = {k: statistics.median(v) for k, v in raw["seconds"].items()}
    cpu = {k: statistics.median(v) for k, v in raw["cpu_seconds"].items()}
    size = raw["bytes"]["hashed"]
    return {
        "command": f"python scripts/bench/checkpoint.py --preset {args.preset} --repeat {args.repeat}",
        "machine": {
            "cpu": _cpu_name(),
            "logical_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "note": "shared VM; other jobs were running",
        },
        "versions": _versions(),
        "preset": args.preset,
        "checkpoint_bytes": raw["bytes"],
        "seconds": raw["seconds"],
        "median_seconds": {k: round(v, 4) for k, v in med.items()},
        "cpu_seconds": raw["cpu_seconds"],
        "median_cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
        "checksum_cost_seconds": _paired_cost(raw["seconds"]),
        "checksum_cost_cpu_seconds": _paired_cost(raw["cpu_seconds"]),
        "hashed_over_unhashed": round(med["hashed"] / med["unhashed"], 4),
        "hashed_over_unhashed_cpu": round(cpu["hashed"] / cpu["unhashed"], 4),
        "verify_gb_per_s": round(size / med["verify"] / 1e9, 2),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _versions() -> dict:
    import accelerate
    import safetensors
    import xxhash

    return {
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "safetensors": safetensors.__version__,
        "xxhash": xxhash.VERSION,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--vocab", type=int, default=30528, help="vocabulary (BERT's 30522 rounded up to 64)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--workdir", type=Path, help="where the checkpoints are written (default: a temporary folder)"
    )
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    args = p.parse_args(argv)
    acc, _ = build_state(args.preset, args.vocab)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        report = summarize(measure(acc, Path(tmp), args.repeat), args)
    med, cpu = report["median_seconds"], report["median_cpu_seconds"]
    print(f"\n{args.preset}: checkpoint {report['checkpoint_bytes']['hashed'] / 1e6:.1f} MB")
    print(f"{'arm':>10} {'median s':>9} {'CPU s':>7}")
    for k in ("hashed", "unhashed", "accelerate", "verify"):
        print(f"{k:>10} {med[k]:>9.3f} {cpu[k]:>7.3f}")
    print(
        f"checksums cost {report['checksum_cost_seconds']:+.3f} s per save, {report['checksum_cost_cpu_seconds']:+.3f} "
        f"CPU s (hashed / unhashed = {report['hashed_over_unhashed']:.3f} wall, "
        f"{report['hashed_over_unhashed_cpu']:.3f} CPU); verify reads {report['verify_gb_per_s']} GB/s"
    )
    if args.out:
        write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
