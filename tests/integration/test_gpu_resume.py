"""CUDA resume in fresh processes (``pytest -m gpu``; skipped without a CUDA device): an fp32 run
stopped and resumed with deterministic algorithms equals a straight one, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import fresh_process_main, make_prepared
from support import tiny_gpu_config as _gpu_config

from bert_mp.core.loop.state import STOPPED_EXIT_CODE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


_DETERMINISTIC_MAIN = fresh_process_main(
    "import torch; torch.use_deterministic_algorithms(True, warn_only=True); "
)


def _run_fresh(cfg, data_root: Path, *extra: str) -> None:
    from bert_mp.core.config import save_config

    cfg_path = Path(cfg.train.output_dir).with_suffix(".yaml")
    save_config(cfg, cfg_path)
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _DETERMINISTIC_MAIN, str(cfg_path), str(data_root), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    want = STOPPED_EXIT_CODE if extra else 0  # a run stopped at a step exits as `bert-mp train` would
    assert proc.returncode == want, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_fp32_resume_is_bit_identical_with_deterministic_algorithms(tmp_path):
    from safetensors.torch import load_file

    from bert_mp.core.storage.files import read_jsonl

    data_root = tmp_path / "data"
    make_prepared(data_root, n_train=40)
    common = dict(max_steps=10, global_batch_size=8, micro_batch_size=4, warmup_steps=2, export=True)
    straight, parts = _gpu_config(tmp_path / "straight", **common), _gpu_config(tmp_path / "parts", **common)
    for cfg in (straight, parts):  # dropout on: the CUDA RNG state must be restored too
        cfg.model.hidden_dropout_prob = cfg.model.attention_probs_dropout_prob = 0.1
    _run_fresh(straight, data_root)
    _run_fresh(parts, data_root, "6")
    parts.train.resume = "latest"
    _run_fresh(parts, data_root)

    def losses(run: str) -> list:
        return [
            (r["step"], r.get("loss/total"), r.get("eval/loss_mlm"))
            for r in read_jsonl(tmp_path / run / "metrics.jsonl")
            if r["kind"] in ("train", "eval")  # a stopped run also records its stop
        ]

    assert losses("straight") == losses("parts")
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
