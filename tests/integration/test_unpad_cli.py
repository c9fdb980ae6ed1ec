"""``bert-mp train configs/quickstart.yaml model.unpad=true`` (packed, compiled; and the padded path and
data.token_budget rows compiled, with inductor): trains, resumes bit-identically in a fresh process,
and exports a folder whose plain-transformers (padded) logits equal the unpadded model's."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import fresh_process_main, run_cli
from transformers import BertForPreTraining

from bert_mp.core.config import load_config, save_config
from bert_mp.core.storage.files import read_jsonl
from bert_mp.model.bert import PretrainingModel
from bert_mp.model.unpad import run_unpadded

ROOT = Path(__file__).resolve().parents[2]


def _overrides(tmp_path: Path, run: str) -> list[str]:
    return [
        "model.unpad=true",
        "data.max_documents=80",
        "data.vocab_size=512",
        "data.max_seq_length=64",
        "data.short_seq_prob=0.5",  # plenty of short rows: padding the unpadded path must skip
        f"data.cache_dir={tmp_path / 'data'}",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        f"train.output_dir={tmp_path / run}",
        "train.max_steps=6",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.save_every=3",
        "train.eval_every=3",
        "train.eval_max_batches=2",
        "train.log_every=1",
        "train.progress_bar=false",
    ]


def _fresh_process(cfg_path: Path, data_root: Path, *stop_at: str) -> None:
    cmd = [sys.executable, "-c", fresh_process_main(), str(cfg_path), str(data_root), *stop_at]
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(run: Path) -> list:
    return [
        (r["step"], r["kind"], r.get("loss/total"), r.get("eval/loss_mlm"))
        for r in read_jsonl(run / "metrics.jsonl")
        if r["kind"] in ("train", "eval")
    ]


def _padded_batch(rows: list[dict], length: int) -> dict[str, torch.Tensor]:
    n = len(rows)
    ids, types, mask = (torch.zeros(n, length, dtype=torch.long) for _ in range(3))
    for r, row in enumerate(rows):
        k = len(row["input_ids"])
        ids[r, :k] = torch.tensor(row["input_ids"])
        types[r, :k] = torch.tensor(row["token_type_ids"])
        mask[r, :k] = 1
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


@pytest.mark.slow  # three fresh training processes of a tiny model
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["data.pack_pairs=true"],
        ["train.compile=model"],
        ["model.unpad=false", "train.compile=model"],
        ["model.unpad=false", "data.token_budget=true", "train.compile=model"],
    ],
    ids=["unpad", "unpad+pack", "unpad+compile", "padded+compile", "budget+compile"],  # inductor: minutes
)
def test_unpadded_quickstart_trains_resumes_and_exports(tmp_path, extra):
    overrides = [*_overrides(tmp_path, "straight"), *extra]
    proc = run_cli("train", str(ROOT / "configs" / "quickstart.yaml"), *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    straight = tmp_path / "straight"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6

    # the same resolved config in fresh processes: stop (and save) after step 4, resume to 6
    cfg = load_config(straight / "config.yaml")
    assert cfg.model.unpad == ("model.unpad=false" not in extra)
    assert cfg.data.pack_pairs == ("data.pack_pairs=true" in extra)
    cfg.train.output_dir = str(tmp_path / "parts")
    cfg_path = tmp_path / "parts.yaml"
    save_config(cfg, cfg_path)
    data_root = next(p.parent for p in (tmp_path / "data").glob("*/stats.json"))
    _fresh_process(cfg_path, data_root, "4")
    cfg.train.resume = "latest"
    save_config(cfg, cfg_path)
    _fresh_process(cfg_path, data_root)
    parts = tmp_path / "parts"
    assert json.loads((parts / "summary.json").read_text())["resumed_from"].endswith("step_00000004")
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(parts / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and len(_losses(straight)) == 8
    if "train.compile=model" in extra:
        compiled = json.loads((straight / "summary.json").read_text())["compile"]
        assert compiled["graphs"] > 0
        if "model.unpad=false" in extra:  # padded: one region, no break (unpadded: the host layout's)
            assert compiled["graph_breaks"] == 0, compiled
        if "data.token_budget=true" in extra:  # one shape: a training graph and an evaluation graph
            assert compiled["graphs"] == 2, compiled
    # exact, every step, compiled too: on CPU the compiled run's scatter-adds keep one order
    # (bert_mp.model.bert.deterministic_inductor), so a fresh process repeats it to the bit; padded,
    # the bucketed lengths keep every graph compiled (no frame passes the recompile limit and runs
    # eagerly in one process but not in the other)
    assert _losses(straight) == _losses(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # the export is a plain checkpoint: its padded logits are the unpadded training model's
    from datasets import load_from_disk

    plain = BertForPreTraining.from_pretrained(straight / "final").eval()
    unpadded = PretrainingModel(copy.deepcopy(plain), unpad=True).eval()
    rows = list(load_from_disk(str(data_root / "dataset"))["train"].select(range(8)))
    assert len({len(r["input_ids"]) for r in rows}) > 1, "want rows of several lengths"
    batch = _padded_batch(rows, 64)
    labels = torch.where(batch["attention_mask"] == 1, 0, -100)
    with torch.no_grad():
        out = plain(**batch)
        seq, pooled, _ = run_unpadded(
            unpadded, batch["input_ids"], batch["token_type_ids"], labels, batch["attention_mask"]
        )
        mlm = unpadded.model.cls.predictions(seq)
        nsp = unpadded.model.cls.seq_relationship(pooled)
    real = batch["attention_mask"].reshape(-1) == 1
    want = out.prediction_logits.reshape(-1, out.prediction_logits.shape[-1])[real]
    torch.testing.assert_close(mlm, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nsp, out.seq_relationship_logits, rtol=1e-4, atol=1e-4)
