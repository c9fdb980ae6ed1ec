"""``bert-mp train`` end to end through the real CLI: prepares the built-in corpus, trains, exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import run_cli

from bert_mp.core.storage.files import read_jsonl


@pytest.mark.slow  # ~40 s of CPU in three fresh processes; minutes on a loaded shared box
def test_cli_train_prepares_trains_and_exports(tmp_path):
    overrides = [
        "data.max_documents=80",
        "data.vocab_size=512",
        "data.max_seq_length=64",
        f"data.cache_dir={tmp_path / 'data'}",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=4",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.eval_max_batches=2",
        "train.progress_bar=false",
    ]
    proc = run_cli("train", *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bert-mp train: completed after 4 steps (final eval MLM loss" in proc.stdout
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["batch"]["accumulation"] == 2
    assert summary["model"]["config"]["vocab_size"] % 64 == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert (run / "final" / "model.safetensors").is_file() and (run / "final" / "tokenizer.json").is_file()

    # user errors end in one line on stderr, exit 2, before any work
    bad = run_cli("train", *overrides, "model.max_position_embeddings=32", cwd=tmp_path)
    assert bad.returncode == 2
    assert "max_position_embeddings" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_cli("train", *overrides, "model.vocab_size=100", cwd=tmp_path)
    assert bad.returncode == 2 and "smaller than the tokenizer" in bad.stderr


def test_precision_the_cpu_lacks_is_one_line_before_any_work(tmp_path):
    """As on an AVX2-only CPU (every capability masked): fp16 is refused naming the key and the opt-in."""
    overrides = [
        "train.precision=fp16",
        f"data.cache_dir={tmp_path / 'data'}",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "BERT_MP_CPU_MASK": "all", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bert_mp.cli", "train", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "train.precision=fp16" in lines[0] and "hardware.allow_emulated=true" in lines[0]
    assert "masked by BERT_MP_CPU_MASK" in lines[0]
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_flush_denormal_holds_on_every_thread_and_is_recorded(tmp_path, prepared):
    """hardware.flush_denormal=true through the CLI: set before torch's thread pool starts, so every
    thread flushes; the start-up line says so and summary.json records it with the subnormal share."""
    from support import tiny_config

    from bert_mp.core.config import save_config

    cfg = tiny_config(tmp_path / "run", max_steps=2)
    cfg.hardware.flush_denormal = True
    cfg.data.cache_dir = str(tmp_path / "data")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / cfg.data.cache_key()).symlink_to(prepared)  # the fixture, as if prepared
    save_config(cfg, tmp_path / "recipe.yaml")
    proc = run_cli("train", "recipe.yaml", "train.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    effect = json.loads((tmp_path / "run" / "summary.json").read_text())["conditions"]
    if "this CPU cannot flush them" in proc.stderr:
        pytest.skip("this CPU cannot flush subnormals (not x86 with SSE3)")
    start = next(line for line in proc.stdout.splitlines() if line.startswith("bert-mp train: 1 process"))
    assert effect["flush_denormal"] == "on" and start.endswith(", subnormals flushed to zero"), proc.stdout
    assert effect["subnormal_share"] == 0.0  # nothing can underflow into the subnormal range
    assert "warning" not in proc.stderr
