"""Golden numbers of a fixed tiny pretraining run (fp32 and bf16), recorded once; the sweep's are in
integration/test_golden_sweep.py.

What is pinned: per-step losses (total / MLM / NSP), learning rates and gradient norms of a 2-layer,
width-32 run with dropout on and 2 micro-batches per step; its final evaluation and a hash of its
final weights. A change that is meant to leave training untouched (a refactor) must pass this
unchanged.

How runs on other CPUs are compared, and the command that re-records (only when a change is *meant*
to alter the numbers): the golden section of support.py. Torch runs single-threaded here so the
thread count of the machine does not enter.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from support import GOLDEN_EVAL_KEYS as EVAL_KEYS
from support import GOLDEN_RECORD as RECORD
from support import GOLDEN_RTOL as RTOL
from support import golden_compare as _compare
from support import golden_fingerprint as fingerprint
from support import golden_load as _load
from support import golden_record as _record
from support import make_prepared, reset_accelerate, tiny_config

TRAIN_KEYS = ("loss/total", "loss/mlm", "loss/nsp", "optim/lr", "optim/grad_norm")


def weights_hash(path: Path) -> str:
    """sha256 over a safetensors file's tensors in key order (independent of file metadata)."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# the runs
# --------------------------------------------------------------------------------------------------
def _single_thread(fn: Any) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def train_run(tmp: Path, precision: str) -> dict[str, Any]:
    """10 steps, global batch 16 as 2 micro-batches of 8, dropout 0.1, warmup 3, eval at the end."""
    from bert_mp.core.storage.files import read_jsonl
    from bert_mp.pretrain.trainer import train

    reset_accelerate()
    data = make_prepared(tmp / "data")
    out = tmp / precision
    cfg = tiny_config(
        out,
        precision=precision,
        max_steps=10,
        global_batch_size=16,
        micro_batch_size=8,
        warmup_steps=3,
        export=False,
    )
    cfg.model.hidden_dropout_prob = 0.1
    cfg.model.attention_probs_dropout_prob = 0.1
    summary = _single_thread(lambda: train(cfg, data))
    rows = list(read_jsonl(out / "metrics.jsonl"))
    return {
        "steps": [{k: r[k] for k in ("step", *TRAIN_KEYS)} for r in rows if r["kind"] == "train"],
        "final_eval": {k: summary["final_eval"][k] for k in EVAL_KEYS},
        "weights_sha256": weights_hash(out / "checkpoints" / "step_00000010" / "model.safetensors"),
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_golden_train_run(tmp_path, precision):
    got = train_run(tmp_path, precision)
    if RECORD:
        _record("train", precision, got)
        return
    golden = _load("train")
    same_machine = golden["fingerprint"] == fingerprint()
    want = golden["runs"][precision]
    problems: list[str] = []
    _compare(got, want, None if same_machine else RTOL[precision], precision, problems)
    assert not problems, "\n".join(problems[:20])
    if not same_machine:
        pytest.skip(
            f"values match within rtol {RTOL[precision]}; weight hash not compared: recorded on "
            f"{golden['fingerprint']}, this machine is {fingerprint()}"
        )
    assert got["weights_sha256"] == want["weights_sha256"]
