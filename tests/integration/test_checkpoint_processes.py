"""checkpoint.py in fresh processes: exact resume mid-epoch, SIGTERM, the CLI's resume-target check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from safetensors.torch import load_file
from support import fresh_process_main, hold_env, make_prepared, run_config, tiny_config, wait_held

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.config import save_config
from bert_mp.core.storage.files import read_jsonl


def _run(
    cfg, data_root: Path, *extra: str, wait: bool = True, env: dict[str, str] | None = None
) -> subprocess.Popen | subprocess.CompletedProcess:
    cfg_path = Path(cfg.train.output_dir).with_suffix(".yaml")
    save_config(cfg, cfg_path)
    cmd = [sys.executable, "-c", fresh_process_main(), str(cfg_path), str(data_root), *extra]
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(env or {}),
    }
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    stopped_early = len(extra) > 0  # a stop-at step: status "stopped", not a signal
    assert proc.returncode == (train_mod.STOPPED_EXIT_CODE if stopped_early else 0), proc.stdout + proc.stderr
    return proc


def test_resume_mid_epoch_in_fresh_process_is_bit_identical(tmp_path):
    data_root = tmp_path / "data"
    make_prepared(data_root, n_train=40)  # 5 global batches of 8 per epoch
    common = dict(
        max_steps=12, global_batch_size=8, micro_batch_size=4, save_every=3, warmup_steps=3, export=True
    )
    straight = tiny_config(tmp_path / "straight", **common)
    parts = tiny_config(tmp_path / "parts", **common)
    for cfg in (straight, parts):  # dropout on: the RNG stream must be restored too
        cfg.model.hidden_dropout_prob = cfg.model.attention_probs_dropout_prob = 0.1
    # the straight run and the first part in this process (support.run_config, as a fresh process
    # runs them); the resume below, the run under test, in a fresh one
    for cfg, stop_at in ((straight, None), (parts, 7)):  # parts stops (and saves) after step 7
        cfg_path = Path(cfg.train.output_dir).with_suffix(".yaml")
        save_config(cfg, cfg_path)
        assert run_config(cfg_path, data_root, stop_at) == (train_mod.STOPPED_EXIT_CODE if stop_at else 0)
    stopped = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert stopped["status"] == "stopped" and stopped["steps"] == 7
    loop_state = json.loads(
        (tmp_path / "parts" / "checkpoints" / "step_00000007" / "loop_state.json").read_text()
    )
    assert (loop_state["epoch"], loop_state["batch_in_epoch"]) == (1, 2)
    parts.train.resume = "latest"
    _run(parts, data_root)
    resumed = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert resumed["resumed_from"].endswith("step_00000007") and resumed["steps"] == 12

    def losses(run: str) -> list:
        return [
            (r["step"], r["kind"], r.get("loss/total"), r.get("eval/loss_mlm"))
            for r in read_jsonl(tmp_path / run / "metrics.jsonl")
            if r["kind"] in ("train", "eval")
        ]

    # the stop-at-step callback of the first part is gone on resume: a recorded config change
    changes = [r for r in read_jsonl(tmp_path / "parts" / "metrics.jsonl") if r["kind"] == "config_change"]
    assert [(r["step"], list(r["changes"])) for r in changes] == [(7, ["train.callbacks"])]

    assert losses("straight") == losses("parts")  # exact float equality, every step
    assert len(losses("straight")) == 13
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.signals
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    """SIGTERM to a run held after step 3 (of 100,000): it saves the step it stopped on, exits 143."""
    data_root = tmp_path / "data"
    make_prepared(data_root)
    cfg = tiny_config(tmp_path / "run", max_steps=100_000, export=False)
    ready = tmp_path / "held"
    proc = _run(cfg, data_root, wait=False, env=hold_env("step:3", ready))
    wait_held(proc, ready)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output  # 128 + SIGTERM: `bert-mp train && ...` does not go on
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stop_reason"] == "signal SIGTERM"
    assert summary["steps"] in (3, 4)  # the step under way when the signal landed is finished
    latest = ckpt.find_latest(tmp_path / "run" / "checkpoints")
    assert latest is not None and latest.name == ckpt.checkpoint_name(summary["steps"])
    assert json.loads((latest / ckpt.LOOP_STATE).read_text())["step"] == summary["steps"]


def test_cli_checks_the_resume_target_before_any_data_work(tmp_path):
    bad = tmp_path / "final"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    proc = forkserver.run(
        [
            sys.executable,
            "-m",
            "bert_mp",
            "train",
            f"train.resume={bad}",
            f"data.cache_dir={tmp_path / 'data'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is a Hugging Face export" in proc.stderr and not (tmp_path / "data").exists()
