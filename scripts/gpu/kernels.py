"""The ``kernels`` phase: the kernel probe per precision (GEMM and attention verdicts weighted by device
time, the kernels with the most device time), each precision written when done."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpu import settings
from gpu.child import read_json, run_child, status

KERNEL_PROBE = """
import json, sys, torch
from transformers import BertForPreTraining
from bert_mp.core.config import ModelConfig
from bert_mp.sweep.diagnostics import probe_precision, synthetic_batch
from bert_mp.errors import HardwareError
from bert_mp.model.bert import PretrainingModel, bert_config
from bert_mp.core.numerics.precision import resolve_precision
out, preset, batch, seq, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
res = {}
for prec in sys.argv[6].split(","):
    try:
        plan = resolve_precision(prec, dev)
    except HardwareError as e:
        res[prec] = "skipped: " + str(e)
        continue
    torch.manual_seed(0)
    model = PretrainingModel(BertForPreTraining(bert_config(ModelConfig(preset=preset), vocab)), max_predictions_per_seq=20).to(dev)
    r = probe_precision(model, synthetic_batch(vocab, batch, seq, dev), plan, steps=2)
    res[prec] = {"verdict": r["kernel_verdict"], "check": r.get("cuda_kernel_check"),
                 "top_kernels": r["cuda_kernels"][:12], "padding_fraction": r["batch_padding_fraction"],
                 "measured_bytes": r["measured_bytes"]}
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    with open(out + ".partial", "w") as f:  # each precision's verdict the moment it is known
        json.dump(res, f, indent=1, default=str)
    import os; os.replace(out + ".partial", out)
"""


def phase_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel probe per precision (GEMM and attention verdicts, top kernels by device time)."""
    out = settings.STATE / "kernels_probe.json"
    out.unlink(missing_ok=True)
    size = (
        ("tiny", "4", "32", "300", "fp32,bf16")
        if args.dry_run
        else ("base", "32", "128", "30528", "fp32,bf16,tf32,fp16")
    )
    rc, tail = run_child(
        [sys.executable, "-c", KERNEL_PROBE, str(out), *size],
        args.budget,
        settings.STATE / "kernels.log",
        tick=lambda: args.progress({"kernels": read_json(out)}),
    )
    return {"status": status(rc), "rc": rc, "kernels": read_json(out), "tail": tail[-1500:]}
