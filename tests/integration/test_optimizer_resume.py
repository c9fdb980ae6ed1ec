"""Every optimizer (and bf16_pure's compensated updates) resumes bit-identically in a fresh process.

The straight run and the first part run in the test's process (support.run_config, as the fresh
process runs them): only the resume, the run under test, pays a process start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import fresh_process_main, make_prepared, run_config, tiny_config

from bert_mp.core.config import save_config
from bert_mp.core.storage.files import read_jsonl


def _save(cfg) -> Path:
    cfg_path = Path(cfg.train.output_dir).with_suffix(".yaml")
    save_config(cfg, cfg_path)
    return cfg_path


def _run_here(cfg, data_root: Path, stop_at: int | None = None) -> None:
    assert run_config(_save(cfg), data_root, stop_at) == (3 if stop_at else 0)


def _run_fresh(cfg, data_root: Path) -> None:
    cmd = [sys.executable, "-c", fresh_process_main(), str(_save(cfg)), str(data_root)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_prepared(root, n_train=40)
    return root


@pytest.mark.parametrize(
    "optimizer, precision, update",
    [
        ("adamw", "fp32", "kahan"),
        ("lamb", "fp32", "kahan"),
        ("sophia", "fp32", "kahan"),
        ("stable_adamw", "fp32", "kahan"),
        ("lion", "fp32", "kahan"),
        ("adamw", "bf16_pure", "kahan"),  # torch-optimi's Kahan state
        ("sophia", "bf16_pure", "stochastic"),  # the step hooks' seeded rounding
    ],
)
def test_resume_is_bit_identical_per_optimizer(tmp_path, data_root, optimizer, precision, update):
    common = dict(
        max_steps=6, global_batch_size=8, micro_batch_size=8, save_every=3, warmup_steps=2, export=True
    )
    runs = {}
    for name in ("straight", "parts"):
        cfg = tiny_config(
            tmp_path / name, optimizer=optimizer, precision=precision, bf16_update=update, **common
        )
        cfg.train.sophia_update_period = 2  # estimates on both sides of the checkpoint
        cfg.model.hidden_dropout_prob = 0.1  # the dropout stream must be restored too
        runs[name] = cfg
    _run_here(runs["straight"], data_root)
    _run_here(runs["parts"], data_root, stop_at=3)
    runs["parts"].train.resume = "latest"
    _run_fresh(runs["parts"], data_root)  # the resume in a fresh process: nothing carried over in memory

    def losses(run: str) -> list:
        rows = read_jsonl(tmp_path / run / "metrics.jsonl")
        return [
            (r["step"], r.get("loss/total"), r.get("eval/loss_mlm"))
            for r in rows
            if r["kind"] in ("train", "eval")
        ]

    assert losses("straight") == losses("parts") and len(losses("straight")) == 7
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32, k  # bf16_pure exports fp32 by default
        assert torch.equal(a[k], b[k]), k
