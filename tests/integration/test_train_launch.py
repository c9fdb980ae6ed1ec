"""Scale-out: 2 processes on CPU (gloo) through ``accelerate launch`` match one process, same global batch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support import launch_config, make_prepared, tiny_config

from bert_mp.core.storage.files import read_jsonl


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_two_process_gloo_matches_single_process(tmp_path):
    data_root = tmp_path / "data"
    make_prepared(data_root, n_train=64)
    runs = {}
    for processes in (1, 2):
        out = tmp_path / f"p{processes}"
        # one process accumulates 2 micro-batches of 4; two processes take one micro-batch of 4 each
        cfg = tiny_config(out, max_steps=4, global_batch_size=8, micro_batch_size=4, export=False)
        launch_config(cfg, data_root, processes)
        batch = json.loads((out / "summary.json").read_text())["batch"]
        assert (batch["processes"], batch["accumulation"]) == (processes, 2 // processes)
        rows = list(read_jsonl(out / "metrics.jsonl"))
        runs[processes] = (
            [r["loss/total"] for r in rows if r["kind"] == "train"],
            [r["eval/loss_mlm"] for r in rows if r["kind"] == "eval"],
            load_file(str(out / "checkpoints" / "step_00000004" / "model.safetensors")),
        )
    (l1, e1, w1), (l2, e2, w2) = runs[1], runs[2]
    assert len(l1) == 4
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6)
    assert e1 == pytest.approx(e2, rel=1e-5)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5)
