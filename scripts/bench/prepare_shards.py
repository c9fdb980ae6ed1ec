"""Prepare on N machines (``data.shard=I/N``): each share's wall time, peak memory and tokens/s
against one prepare of the whole corpus, each a fresh ``bert-mp prepare`` process.

A corpus of ``--size`` bytes is generated offline (``scripts/bench/prepare.py``'s shapes) with a fixed
tokenizer; the whole corpus is prepared once, then each share in turn (as N machines would at the
same time). Peak memory is the process's and its workers' resident peak (``stats.json``'s
``memory``, from ``getrusage``), which counts the memory-mapped Arrow pages it touched.

    python scripts/bench/prepare_shards.py --size 50MB --shares 3 --out docs/benchmarks/prepare_shards_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bert_mp.core.process.noise import quiet_libraries  # noqa: E402

quiet_libraries()  # the libraries' chatter off the console, before they load, as `bert-mp` does

from bench.harness import write_report  # noqa: E402
from bench.prepare import ensure_tokenizer, parse_size, write_corpus  # noqa: E402


def prepare(files: list[Path], tokenizer: Path, cache: Path, shard: str, num_proc: int) -> dict:
    """One ``bert-mp prepare`` in a fresh process; its stats.json figures and wall time."""
    args = [
        "data.source=text",
        "data.paths=[" + ",".join(str(f) for f in files) + "]",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={cache}",
        f"data.num_proc={num_proc}",
        f"data.shard={shard}",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "bert_mp", "prepare", *args], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"prepare {shard} failed: {proc.stderr[-2000:]}")
    folder = next(line.split(" -> ")[1] for line in proc.stdout.splitlines() if line.startswith("prepared "))
    stats = json.loads((Path(folder) / "stats.json").read_text())
    return {
        "shard": shard,
        "wall_s": round(wall, 2),
        "tokens": stats["tokens"],
        "tokens_per_sec": stats["tokens_per_sec"],
        "seconds": stats["seconds"],
        "documents": (stats.get("shard") or {}).get("documents"),
        "train_examples": stats["per_split"]["train"]["examples"],
        "peak_rss_bytes": stats["memory"]["peak_rss_bytes"],
        "workers_peak_rss_bytes": stats["memory"]["workers_peak_rss_bytes"],
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="50MB")
    p.add_argument("--shape", default="builtin")
    p.add_argument("--shares", type=int, default=3)
    p.add_argument("--num-proc", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=Path("runs/bench_prepare_shards"))
    p.add_argument("--out", type=Path, default=Path("runs/bench_prepare_shards.json"))
    args = p.parse_args(argv)
    work = args.workdir.resolve()
    files = write_corpus(work / "corpus", parse_size(args.size), args.shape)
    tokenizer = ensure_tokenizer(work / "tokenizer", 8192)
    import datasets
    import tokenizers
    import torch

    report: dict = {
        "command": "python scripts/bench/prepare_shards.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": sys.platform},
        "versions": {
            "datasets": datasets.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__,
        },
        "corpus": {"bytes": sum(f.stat().st_size for f in files), "files": len(files), "shape": args.shape},
        "num_proc": args.num_proc,
        "runs": [],
    }
    for shard in ["0/1", *(f"{i}/{args.shares}" for i in range(args.shares))]:
        row = prepare(files, tokenizer, work / "cache", shard, args.num_proc)
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
        write_report(report, args.out)  # each row as soon as it is measured
    whole, shares = report["runs"][0], report["runs"][1:]
    report["summary"] = {
        "whole_wall_s": whole["wall_s"],
        "slowest_share_wall_s": max(r["wall_s"] for r in shares),
        "speedup_on_n_machines": whole["wall_s"] / max(r["wall_s"] for r in shares),
        "whole_peak_rss_bytes": whole["peak_rss_bytes"],
        "largest_share_peak_rss_bytes": max(r["peak_rss_bytes"] for r in shares),
        "shares_tokens_sum": sum(r["tokens"] for r in shares),
        "whole_tokens": whole["tokens"],
    }
    write_report(report, args.out)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
