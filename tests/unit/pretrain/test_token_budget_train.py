"""data.token_budget through the training loop: one compiled shape over 50 steps of very different lengths,
and a resume mid-epoch that repeats the uninterrupted run to the bit."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from datasets import Dataset, DatasetDict
from support import load_script, make_tokenizer, reset_accelerate, tiny_config

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.storage.files import read_jsonl

drill = load_script("drills/fault")
L = 32


def _pairs(n: int, seed: int) -> Dataset:
    """NSP pairs of two very different length regimes, interleaved: 6-11 tokens and 16-32 tokens."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {"input_ids": [], "token_type_ids": [], "next_sentence_label": []}
    for i in range(n):
        k = int(rng.integers(6, 12)) if i % 2 else int(rng.integers(L - 16, L + 1))
        la = (k - 3) // 2
        lb = k - 3 - la
        cols["input_ids"].append(
            [2, *rng.integers(5, 64, la).tolist(), 3, *rng.integers(5, 64, lb).tolist(), 3]
        )
        cols["token_type_ids"].append([0] * (la + 2) + [1] * (lb + 1))
        cols["next_sentence_label"].append(int(rng.integers(0, 2)))
    return Dataset.from_dict(cols)


@pytest.fixture(scope="module")
def data() -> SimpleNamespace:
    stats = {"tokenizer_size": 64, "model_vocab_size": 64, "max_seq_length": L}
    splits = DatasetDict(train=_pairs(120, 1), validation=_pairs(16, 2))
    return SimpleNamespace(dataset=splits, tokenizer=make_tokenizer(), stats=stats, path="")


def _config(out, **train):
    cfg = tiny_config(out, global_batch_size=8, micro_batch_size=4, **train)
    cfg.data.token_budget = True
    cfg.validate()
    return cfg


def _examples_per_step(run) -> list[int]:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    return [round(r["throughput/seqs_per_sec"] * r["time/step_ms"] / 1000) for r in rows]


def test_fifty_compiled_steps_of_mixed_lengths_compile_one_training_graph(data, tmp_path, monkeypatch):
    """torch.compile with the aot_eager backend: dynamo's capture and guards plus AOT autograd's joint
    forward + backward trace - everything that decides a recompile - without inductor's code
    generation (minutes of CPU; the slow CLI test runs inductor). What it proves: the step's inputs
    have one shape, so no step after the first compiles."""
    monkeypatch.setattr(
        train_mod,
        "compile_model",
        lambda model, mode, **kw: model.compile(backend="aot_eager", dynamic=False) or model,
    )
    reset_accelerate()
    run = tmp_path / "run"
    cfg = _config(run, max_steps=50, compile="model", eval_every=25, eval_max_batches=1, save_every=0)
    summary = train_mod.train(cfg, data)
    # one graph for training, one for evaluation (no grad), whatever each micro-batch holds
    assert summary["compile"]["graphs"] == 2 and summary["compile"]["graph_breaks"] == 0, summary["compile"]
    sizes = _examples_per_step(run)
    # 8 rows a step hold up to 2 examples each (an epoch's last step fewer): different numbers, one shape
    assert len(sizes) == 50 and min(sizes) < max(sizes) <= 16 and len(set(sizes)) >= 4, sizes
    assert summary["data"]["token_budget"] == {
        "rows": 4,
        "max_seq_length": L,
        "examples_per_row": 2,
        "attention": "block_diagonal",
    }
    assert summary["throughput"]["positions_per_sec"] > summary["throughput"]["tokens_per_sec"] > 0
    assert summary["final_eval"]["eval/accuracy_nsp"] is not None


def test_a_resume_mid_epoch_repeats_the_uninterrupted_run_to_the_bit(data, tmp_path):
    """12 steps straight (an epoch is ~10 steps) against the same run resumed from its checkpoint at
    step 5: the carried example's position is in loop_state.json and every loss and weight repeats."""
    reset_accelerate()
    straight = tmp_path / "straight"
    train_mod.train(_config(straight, max_steps=12, save_every=5, save_total_limit=3, eval_every=6), data)
    state = json.loads((straight / "checkpoints" / "step_00000005" / "loop_state.json").read_text())
    assert state["epoch"] == 0 and state["batch_in_epoch"] == 5 and 0 < state["data_offset"] < 120
    after = json.loads((straight / "checkpoints" / "step_00000012" / "loop_state.json").read_text())
    assert after["epoch"] == 1  # the run crosses an epoch boundary after the resume point
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for later in ("step_00000010", "step_00000012"):
        shutil.rmtree(resumed / "checkpoints" / later, ignore_errors=True)
    reset_accelerate()
    cfg = _config(resumed, max_steps=12, save_every=5, save_total_limit=3, eval_every=6)
    cfg.train.resume = "latest"
    summary = train_mod.train(cfg, data)
    assert summary["resumed_from"].endswith("step_00000005") and summary["steps"] == 12
    assert drill.compare(straight, resumed) == []
