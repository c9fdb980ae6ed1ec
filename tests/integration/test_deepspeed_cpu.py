"""DeepSpeed ZeRO-1 and ZeRO-2 on CPU: through Accelerate, over gloo (DeepSpeed's CPU accelerator).

Accelerate drops DeepSpeed for ``cpu=True``; bert_mp starts it with ``cpu=False`` and the gloo backend
(``bert_mp/core/engine/strategy.py``), so the engine shards as on GPUs. Two processes under
``configs/accelerate/deepspeed_zero2.yaml`` (``--zero_stage 1`` for ZeRO-1) give one process's losses,
gradient norms (the engine's, measured before its clipping) and exported weights for the same global
batch; each rank writes its own partition of the optimizer state; the run states its strategy.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import ROOT, launch_config, make_prepared, run_config, tiny_config

from bert_mp.core.config import save_config
from bert_mp.core.storage.files import read_jsonl

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]

ZERO2 = ("--config_file", str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
STEPS = 4


def _config(out: Path, **kw):
    # DeepSpeed keeps accumulation at 1: a micro-batch of 4 on each of 2 processes, 8 on one
    return tiny_config(out, max_steps=STEPS, global_batch_size=8, warmup_steps=1, **kw)


def _train_rows(out: Path) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepspeed")
    make_prepared(root / "data", n_train=64)
    out = {"p1": root / "p1", "zero1": root / "zero1", "zero2": root / "zero2"}
    # the one-process reference trains in this process: the code of a one-process launch, without
    # the launcher's and the rank's start
    save_config(_config(out["p1"], micro_batch_size=8), root / "p1.yaml")
    assert run_config(root / "p1.yaml", root / "data") == 0
    launch_config(
        _config(out["zero1"], micro_batch_size=4), root / "data", 2, options=(*ZERO2, "--zero_stage", "1")
    )
    launch_config(_config(out["zero2"], micro_batch_size=4), root / "data", 2, options=ZERO2)
    return out


@pytest.mark.parametrize(("name", "stage"), [("zero1", 1), ("zero2", 2)])
def test_zero_matches_one_process_and_states_its_stage(runs, name, stage):
    ref, rows = _train_rows(runs["p1"]), _train_rows(runs[name])
    assert [r["loss/total"] for r in rows] == pytest.approx([r["loss/total"] for r in ref], rel=1e-5)
    assert [r["optim/grad_norm"] for r in rows] == pytest.approx(
        [r["optim/grad_norm"] for r in ref], rel=1e-5
    )
    a = load_file(str(runs["p1"] / "final" / "model.safetensors"))
    b = load_file(str(runs[name] / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    summary = json.loads((runs[name] / "summary.json").read_text())
    s = summary["strategy"]
    # the optimizer that updates, looked up through DeepSpeed's and Accelerate's wrappers
    assert (summary["optimizer"]["class"], summary["optimizer"]["library"]) == ("AdamW", "torch")
    assert (s["name"], s["details"]["zero_stage"], s["backend"], s["parameters_sharded"]) == (
        "deepspeed",
        stage,
        "gloo",
        False,
    )
    assert s["label"].startswith(f"DeepSpeed ZeRO-{stage} (")
    # each rank saved its own partition of the optimizer state
    parts = sorted(p.name for p in (runs[name] / "checkpoints").glob("step_*/pytorch_model/*optim_states.pt"))
    assert len(parts) == 2, parts


def test_a_flipped_byte_in_a_ranks_optimizer_partition_is_found_and_latest_falls_back(runs, tmp_path):
    """DeepSpeed's own files sit under bert_mp's manifest like any other: a flipped byte in one rank's
    partition makes ``train.resume=latest`` skip that checkpoint with one line, for the one before."""
    import shutil
    import warnings

    from bert_mp.core.checkpoint import store as ckpt

    saved = runs["zero2"] / "checkpoints" / ckpt.checkpoint_name(STEPS)
    older, newest = tmp_path / ckpt.checkpoint_name(2), tmp_path / ckpt.checkpoint_name(STEPS)
    shutil.copytree(saved, older)
    shutil.copytree(saved, newest)
    part = sorted(newest.glob("pytorch_model/*optim_states.pt"))[-1]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert ckpt.resolve_resume("latest", tmp_path) == older
    assert [str(w.message) for w in said] == [
        f"skipping checkpoint {newest}: {part.relative_to(newest).as_posix()} does not match its checksum "
        "(corrupted or altered since it was written)"
    ]
