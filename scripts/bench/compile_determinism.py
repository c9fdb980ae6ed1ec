"""Cost of deterministic inductor code on CPU (``bert_mp.model.bert.deterministic_inductor``).

One inductor-compiled ``PretrainingModel`` (fast dropout, as the CPU trainer runs it) trains on the
same micro-batch with ``torch.use_deterministic_algorithms`` off and on, the two settings taking turns
step by step (dynamo guards on the flag, so each setting has its own compiled graphs, both compiled
during the warm-up). Forward, backward and AdamW per step, in process CPU seconds and wall seconds;
the ratio is taken within the run. Prints and writes JSON.

    python scripts/bench/compile_determinism.py --preset mini --rows 16 --seq 128 --steps 6 \
        --out docs/benchmarks/compile_deterministic_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch._dynamo.config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.harness import write_report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mini")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="timed steps per setting")
    p.add_argument("--padded", action="store_true", help="the padded encoder instead of model.unpad")
    p.add_argument("--out", default="runs/bench_compile_determinism.json")
    args = p.parse_args()

    from transformers import BertForPreTraining

    from bert_mp.core.config import DataConfig, ModelConfig
    from bert_mp.model.bert import PretrainingModel, bert_config, compile_model
    from bert_mp.model.dropout import install_fast_dropout
    from bert_mp.model.unpad import compiled_graphs, prepare_for_compile

    torch._dynamo.config.recompile_limit = 64  # two settings double the graph variants: compile them all
    torch.manual_seed(0)
    model = BertForPreTraining(bert_config(ModelConfig(preset=args.preset), vocab_size=8192))
    install_fast_dropout(model)
    wrapped = PretrainingModel(model, unpad=not args.padded)
    if not args.padded:
        prepare_for_compile(wrapped, DataConfig(max_seq_length=args.seq))
    compile_model(wrapped, "model")
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.rows,), generator=g)
    mask = (torch.arange(args.seq)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 8192, (args.rows, args.seq), generator=g) * mask
    labels = torch.where((torch.rand(args.rows, args.seq, generator=g) < 0.15) & (mask == 1), ids, -100)
    batch = {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": mask,
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (args.rows,), generator=g),
    }
    warmup = 2
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for step in range(warmup + args.steps):
        for det in (False, True) if step % 2 == 0 else (True, False):
            torch.use_deterministic_algorithms(det, warn_only=True)
            c0, w0 = time.process_time(), time.perf_counter()
            o = wrapped(**batch)
            (o["mlm_loss_sum"] / 100 + o["nsp_loss_sum"] / args.rows).backward()
            opt.step()
            opt.zero_grad()
            if step >= warmup:
                times[det].append((time.process_time() - c0, time.perf_counter() - w0))
    torch.use_deterministic_algorithms(False)
    mean = {k: [sum(t[i] for t in v) / len(v) for i in (0, 1)] for k, v in times.items()}
    report = {
        "command": "python scripts/bench/compile_determinism.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "padded")
        + (" --padded" if args.padded else ""),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
        "versions": {"torch": torch.__version__},
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "step_cpu_s": {"default": mean[False][0], "deterministic": mean[True][0]},
        "step_wall_s": {"default": mean[False][1], "deterministic": mean[True][1]},
        "ratio_deterministic_over_default_cpu": mean[True][0] / mean[False][0],
        "ratio_deterministic_over_default_wall": mean[True][1] / mean[False][1],
        "compiled_graphs": compiled_graphs(),
        "note": "a shared, loaded machine: only the ratios within this run mean anything",
    }
    write_report(report, args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
