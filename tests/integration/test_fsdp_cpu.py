"""FSDP2 on CPU (gloo), through bert_mp's ``fully_shard`` wrap: 2 and 4 processes train like 1.

One process, then 2 and 4 under ``configs/accelerate/fsdp.yaml``, the same global batch of 8: every
step's loss and gradient norm (before clipping: a gradient summed instead of averaged over the ranks,
pytorch issue #162338, would show there and hide in the loss behind Adam), the evaluation, and the
exported weights agree within fp32 tolerance. The sharded checkpoint verifies against bert_mp's
manifest (a flipped byte in a shard is found, and a resume falls back past it), resumes
bit-identically, and ``bert-mp export`` turns it into the same Hugging Face folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from safetensors.torch import load_file
from support import ROOT, launch_config, make_prepared, run_config, tiny_config

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.engine.sharding import SHARDED_DIR
from bert_mp.core.storage.files import read_jsonl

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")

FSDP = ("--config_file", str(ROOT / "configs" / "accelerate" / "fsdp.yaml"))
STEPS = 4


def _config(out: Path, **kw):
    # micro-batch 2: 1 process accumulates 4, 2 processes 2, 4 processes 1 - the same global batch of 8
    args = dict(max_steps=STEPS, global_batch_size=8, micro_batch_size=2, save_every=2, warmup_steps=1)
    return tiny_config(out, **{**args, **kw})


def _rows(out: Path) -> tuple[list[dict], list[dict]]:
    rows = list(read_jsonl(out / "metrics.jsonl"))
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One process (no FSDP: nothing to shard; in this process, the code a one-process launch runs)
    and FSDP over 2 and 4 processes, each in its own launch."""
    from bert_mp.core.config import save_config

    root = tmp_path_factory.mktemp("fsdp")
    make_prepared(root / "data", n_train=64)
    out = {"p1": root / "p1", "fsdp2": root / "fsdp2", "fsdp4": root / "fsdp4"}
    save_config(_config(out["p1"]), root / "p1.yaml")
    assert run_config(root / "p1.yaml", root / "data") == 0
    launch_config(_config(out["fsdp2"]), root / "data", 2, options=FSDP)
    launch_config(_config(out["fsdp4"]), root / "data", 4, options=FSDP)
    out["data"] = root / "data"
    return out


@pytest.mark.parametrize("name", ["fsdp2", "fsdp4"])
def test_fsdp_matches_one_process_losses_gradients_and_weights(runs, name):
    (ref_train, ref_eval), (train, evals) = _rows(runs["p1"]), _rows(runs[name])
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # fp32: the ranks' partial sums are added in another order, nothing else differs
    assert [r["loss/total"] for r in train] == pytest.approx([r["loss/total"] for r in ref_train], rel=1e-5)
    assert [r["optim/grad_norm"] for r in train] == pytest.approx(
        [r["optim/grad_norm"] for r in ref_train], rel=1e-5
    )
    assert [r["eval/loss_mlm"] for r in evals] == pytest.approx(
        [r["eval/loss_mlm"] for r in ref_eval], rel=1e-5
    )
    ref_w = load_file(str(runs["p1"] / "final" / "model.safetensors"))
    w = load_file(str(runs[name] / "final" / "model.safetensors"))
    assert ref_w.keys() == w.keys()
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "processes"), [("fsdp2", 2), ("fsdp4", 4)])
def test_fsdp_states_and_records_its_strategy_and_saves_one_shard_per_rank(runs, name, processes):
    summary = json.loads((runs[name] / "summary.json").read_text())
    s = summary["strategy"]
    assert (s["name"], s["processes"], s["engine"], s["backend"]) == (
        "fsdp",
        processes,
        "bert_mp fully_shard",
        "gloo",
    )
    assert s["parameters_sharded"] and s["sharded"] == ["parameters", "gradients", "optimizer state"]
    assert json.loads((runs["p1"] / "summary.json").read_text())["strategy"]["name"] == "single"
    folder = runs[name] / "checkpoints" / ckpt.checkpoint_name(STEPS)
    shards = sorted(p.name for p in (folder / SHARDED_DIR).iterdir())
    assert len(shards) == processes and all(n.endswith(".safetensors") for n in shards)
    assert not (folder / "model.safetensors").exists()  # no whole model: the shards are the model
    listed = json.loads((folder / ckpt.MARKER).read_text())["files"]
    assert all(f"{SHARDED_DIR}/{n}" in listed for n in shards)  # bert_mp's manifest covers the shards
    assert ckpt.verify(folder) is None


def test_a_flipped_bit_in_a_shard_is_found_before_anything_loads(runs, tmp_path):
    import shutil

    folder = tmp_path / "step"
    shutil.copytree(runs["fsdp2"] / "checkpoints" / ckpt.checkpoint_name(STEPS), folder)
    shard = sorted((folder / SHARDED_DIR).iterdir())[-1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    assert (
        ckpt.verify(folder)
        == f"{SHARDED_DIR}/{shard.name} does not match its checksum (corrupted or altered since it was written)"
    )


def test_fsdp_resumes_bit_identically_in_fresh_processes_past_a_damaged_shard(runs, tmp_path):
    """3 steps, stop (checkpoints of shards at 2 and 3); a byte of the newest checkpoint's last shard
    flipped; a fresh launch with ``train.resume=latest`` skips that checkpoint with one warning naming
    the shard, resumes from step 2 and runs to 4: every logged loss and every exported weight equal to
    the straight 4-step run, to the bit (the plain case: tests/unit/pretrain/test_faults.py)."""
    parts = tmp_path / "parts"
    launch_config(
        _config(parts), runs["data"], 2, options=FSDP, stop_at=3, codes=(1,)
    )  # a stopped run exits 3
    assert json.loads((parts / "summary.json").read_text())["status"] == "stopped"
    newest = parts / "checkpoints" / ckpt.checkpoint_name(3)
    shard = sorted((newest / SHARDED_DIR).iterdir())[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = launch_config(_config(parts, resume="latest"), runs["data"], 2, options=FSDP)
    # one warning per process here (the test's script, not bert-mp's CLI, which prints rank 0's only)
    said = {
        line.split("BertMPWarning: ")[-1]
        for line in proc.stderr.splitlines()
        if "skipping checkpoint" in line
    }
    assert said == {
        f"skipping checkpoint {newest}: {SHARDED_DIR}/{shard.name} does not match its checksum "
        "(corrupted or altered since it was written)"
    }, proc.stderr[-3000:]
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["resumed_from"] == str(parts / "checkpoints" / ckpt.checkpoint_name(2))
    straight, resumed = _rows(runs["fsdp2"])[0], _rows(parts)[0]
    assert [r["loss/total"] for r in resumed] == [r["loss/total"] for r in straight]
    assert [r["optim/grad_norm"] for r in resumed] == [r["optim/grad_norm"] for r in straight]
    a = load_file(str(runs["fsdp2"] / "final" / "model.safetensors"))
    b = load_file(str(parts / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint_exports_to_a_folder_from_pretrained_loads_with_the_same_logits(runs, tmp_path):
    """``bert-mp export`` of the last sharded checkpoint (one process, no process group) writes what
    the run's own export wrote; ``from_pretrained`` gives the one-process run's logits."""
    from transformers import BertForPreTraining

    dest = tmp_path / "exported"
    proc = forkserver.run(
        [sys.executable, "-m", "bert_mp", "export", str(runs["fsdp2"]), "--out", str(dest)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(str(runs["fsdp2"] / "final" / "model.safetensors"))
    b = load_file(str(dest / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(5, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, folder in (("fsdp", dest), ("p1", runs["p1"] / "final")):
        model = BertForPreTraining.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            logits[name] = model(input_ids=ids).prediction_logits
    torch.testing.assert_close(logits["fsdp"], logits["p1"], rtol=1e-4, atol=1e-4)
