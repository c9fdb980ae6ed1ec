"""Every optimizer (and bf16_pure's compensated updates, and fp16's loss scaler) resumes bit-identically
in a fresh process.

The straight runs and the first parts run in the test's process (support.run_config, as the fresh
process runs them); the resumes, the runs under test, run one after another in one fresh process,
which never held any of these runs' first parts: only one process start for all of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import TESTS, make_prepared, run_config, tiny_config

from bert_mp.core.config import save_config
from bert_mp.core.storage.files import read_jsonl


def _save(cfg) -> Path:
    cfg_path = Path(cfg.train.output_dir).with_suffix(".yaml")
    save_config(cfg, cfg_path)
    return cfg_path


def _run_here(cfg, data_root: Path, stop_at: int | None = None) -> None:
    assert run_config(_save(cfg), data_root, stop_at) == (3 if stop_at else 0)


RESUME_ALL = (
    f"import sys; sys.path.insert(0, {str(TESTS)!r}); import support; from pathlib import Path; "
    "data = Path(sys.argv[1]); "
    "sys.exit(max(support.run_config(Path(c), data) for c in sys.argv[2:]))"
)
"""``python -c`` code: resume each config saved at ``argv[2:]`` in turn on the fixture at ``argv[1]``."""

CASES = [
    ("adamw", "fp32", "kahan"),
    ("adamw", "fp16", "kahan"),  # the GradScaler's scale and growth count (emulated on a CPU without fp16)
    ("lamb", "fp32", "kahan"),
    ("sophia", "fp32", "kahan"),
    ("stable_adamw", "fp32", "kahan"),
    ("lion", "fp32", "kahan"),
    ("adamw", "bf16_pure", "kahan"),  # torch-optimi's Kahan state
    ("sophia", "bf16_pure", "stochastic"),  # the step hooks' seeded rounding
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[tuple[str, str, str], Path]:
    """Per case: the straight run and the run stopped at step 3, both here, then every resume in one
    fresh process (nothing carried over in memory from the first parts)."""
    data_root = tmp_path_factory.mktemp("data")
    make_prepared(data_root, n_train=40)
    common = dict(
        max_steps=6, global_batch_size=8, micro_batch_size=8, save_every=3, warmup_steps=2, export=True
    )
    folders, resumes = {}, []
    for optimizer, precision, update in CASES:
        root = tmp_path_factory.mktemp(f"{optimizer}-{precision}")
        runs = {}
        for name in ("straight", "parts"):
            cfg = tiny_config(
                root / name, optimizer=optimizer, precision=precision, bf16_update=update, **common
            )
            cfg.train.sophia_update_period = 2  # estimates on both sides of the checkpoint
            cfg.model.hidden_dropout_prob = 0.1  # the dropout stream must be restored too
            cfg.train.fp16_growth_interval = 2  # fp16: the scale grows across the checkpoint (3 of 2+2)
            runs[name] = cfg
        _run_here(runs["straight"], data_root)
        _run_here(runs["parts"], data_root, stop_at=3)
        runs["parts"].train.resume = "latest"
        resumes.append(str(_save(runs["parts"])))
        folders[(optimizer, precision, update)] = root
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", RESUME_ALL, str(data_root), *resumes]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folders


@pytest.mark.parametrize("optimizer, precision, update", CASES)
def test_resume_is_bit_identical_per_optimizer(resumed, optimizer, precision, update):
    root = resumed[(optimizer, precision, update)]

    def losses(run: str) -> list:
        rows = read_jsonl(root / run / "metrics.jsonl")
        return [
            (r["step"], r.get("loss/total"), r.get("eval/loss_mlm"), r.get("amp/loss_scale"))
            for r in rows
            if r["kind"] in ("train", "eval")
        ]

    assert losses("straight") == losses("parts") and len(losses("straight")) == 7
    if precision == "fp16":  # the scale moved during the run: a resume that lost it would differ here
        assert len({row[3] for row in losses("straight") if row[3] is not None}) > 1, losses("straight")
    a = load_file(str(root / "straight" / "final" / "model.safetensors"))
    b = load_file(str(root / "parts" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32, k  # bf16_pure exports fp32 by default
        assert torch.equal(a[k], b[k]), k
