"""Torch elastic's rendezvous for ``--num_machines 2``: static (with ``--rdzv_conf timeout=S``) against
c10d (``--rdzv_backend c10d --rdzv_conf join_timeout=S``), two "machines" on this host.

For each backend: machine 0 alone and machine 1 alone (what ends the wait, after how long, the
error's last line), then both, machine 1's launcher started first: which machine's processes get
the run's rank 0 (the process that writes a run folder, holds its lock and prints). The launched
program only prints its ``RANK``, so nothing trains; every figure is an ``accelerate launch`` as
``bert-mp launch`` runs it.

    python scripts/bench/rendezvous.py --timeout 5 --out docs/benchmarks/rendezvous_cpu.json
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.harness import machine_record, write_report  # noqa: E402

PRINT_RANK = "import os; print('RANK', os.environ['RANK'], flush=True)"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _machine(backend: str, rank: int, port: int, timeout: int, prog: Path) -> list[str]:
    """One machine's ``accelerate launch`` of 1 of 2 processes."""
    if backend == "static":
        rdzv = ["--rdzv_conf", f"timeout={timeout}"]
    else:  # which machine hosts c10d's store: said, not guessed from the address (both are this host)
        rdzv = [
            "--rdzv_backend",
            "c10d",
            "--rdzv_conf",
            f"join_timeout={timeout},read_timeout={timeout},is_host={int(rank == 0)}",
        ]
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "2", "--machine_rank", str(rank),
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2",
        "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no", *rdzv, str(prog),
    ]  # fmt: skip


def alone(backend: str, rank: int, timeout: int, prog: Path) -> dict:
    """One machine without the other: how its wait ends."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        _machine(backend, rank, _port(), timeout, prog), capture_output=True, text=True, timeout=600
    )
    errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln and not ln.startswith(" ")]
    return {
        "machine_rank": rank,
        "exit_code": proc.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "stderr_lines": len(proc.stderr.splitlines()),
        "last_error": errors[-1] if errors else None,
    }


def together(backend: str, timeout: int, prog: Path) -> dict:
    """Both machines, machine 1's launcher started first: the RANK each machine's process printed."""
    port = _port()
    first = subprocess.Popen(
        _machine(backend, 1, port, timeout, prog), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # started second: the higher pid (c10d orders the machines by host name, then launcher pid)
    second = subprocess.Popen(
        _machine(backend, 0, port, timeout, prog), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    outs = {1: first.communicate(timeout=600), 0: second.communicate(timeout=600)}
    ranks = {
        m: [ln.split()[1] for ln in out.splitlines() if ln.startswith("RANK ")]
        for m, (out, _) in outs.items()
    }
    warned = [
        ln.split("] ", 1)[-1] for _, err in outs.values() for ln in err.splitlines() if "node_rank" in ln
    ]
    return {
        "exit_codes": {0: second.returncode, 1: first.returncode},
        "ranks_by_machine_rank": ranks,
        "rank_0_on_machine_rank": next((m for m, r in ranks.items() if "0" in r), None),
        "warnings": sorted(set(warned)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=int, default=5, help="the join timeout given to each backend (s)")
    p.add_argument("--out", default="runs/rendezvous.json")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report: dict = {"machine": machine_record(), "timeout_s": args.timeout, "results": {}}
    with tempfile.TemporaryDirectory(prefix="bert-mp-rdzv-") as work:
        prog = Path(work) / "print_rank.py"
        prog.write_text(PRINT_RANK + "\n")
        for backend in ("static", "c10d"):
            res = report["results"][backend] = {}
            for rank in (0, 1):
                res[f"machine_{rank}_alone"] = alone(backend, rank, args.timeout, prog)
                write_report(report, args.out)  # each result the moment it is measured
                print(backend, rank, res[f"machine_{rank}_alone"], flush=True)
            res["both_machine_1_first"] = together(backend, max(args.timeout, 60), prog)
            write_report(report, args.out)
            print(backend, res["both_machine_1_first"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
