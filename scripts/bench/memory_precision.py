#!/usr/bin/env python
"""Non-activation memory (weights + gradients + optimizer state) per precision and optimizer.

Builds one model preset, runs one training step per (precision, optimizer) through the sweep's
memory probe (``bert_mp.sweep.diagnostics.probe_precision``, the same bookkeeping the sweep report
shows) and prints bytes per parameter and the saving of each mode against bf16 autocast with the
same optimizer. Byte counts are exact storage sizes, independent of the machine's speed.

    python scripts/bench/memory_precision.py --preset mini --out docs/benchmarks/memory_precision.json
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch
from transformers import BertForPreTraining

from bert_mp.core.config import ModelConfig, TrainConfig
from bert_mp.core.numerics.precision import device_name, library_versions, resolve_precision
from bert_mp.model.bert import PretrainingModel, bert_config
from bert_mp.sweep.diagnostics import probe_precision, synthetic_batch

STATE = ("weights", "gradients", "optimizer_state")


def measure(preset: str, vocab: int, precision: str, optimizer: str, update: str) -> dict:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = PretrainingModel(BertForPreTraining(bert_config(ModelConfig(preset=preset), vocab)))
    plan = resolve_precision(precision, cpu, allow_emulated=True, bf16_update=update)
    loop = TrainConfig(precision=precision, optimizer=optimizer, bf16_update=update)
    r = probe_precision(model, synthetic_batch(vocab, 2, 64, cpu), plan, steps=1, loop_cfg=loop)
    state = sum(r["measured_bytes"][k] for k in STATE)
    return {
        "precision": precision,
        "optimizer": optimizer,
        "bf16_update": update if precision == "bf16_pure" else None,
        "parameters": r["parameters"],
        "bytes_per_parameter": r["measured_bytes_per_parameter"],
        "state_bytes": state,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--optimizers", default="adamw,lamb,sophia")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for opt in args.optimizers.split(","):
        modes = [("bf16", "kahan"), ("bf16_pure", "kahan"), ("bf16_pure", "none"), ("fp8", "kahan")]
        measured = [measure(args.preset, args.vocab, p, opt, u) for p, u in modes]
        amp = measured[0]["state_bytes"]
        for m in measured:
            m["saving_vs_bf16_autocast"] = 1 - m["state_bytes"] / amp
            rows.append(m)
            per = m["bytes_per_parameter"]
            label = m["precision"] + (f" ({m['bf16_update']})" if m["bf16_update"] else "")
            print(
                f"{opt:<8} {label:<18} {' / '.join(f'{per[k]:.1f}' for k in STATE):<18} "
                f"{m['state_bytes'] / 2**20:8.1f} MiB  saving {m['saving_vs_bf16_autocast']:6.1%}"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "date": date.today().isoformat(),
            "device": device_name(torch.device("cpu")),
            "versions": library_versions(),
            "preset": args.preset,
            "vocab_size": args.vocab,
            "command": f"python scripts/bench/memory_precision.py --preset {args.preset} --out {args.out}",
            "rows": rows,
        }
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
