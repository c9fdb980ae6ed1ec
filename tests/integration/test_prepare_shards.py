"""Prepare split across machines: ``data.shard=I/N`` prepares a contiguous share of the documents
(``datasets``' ``Dataset.shard``) into its own folder; ``train.prepared`` trains on the N folders.

Given the tokenizer of a single-machine prepare, the three shares together hold exactly its documents,
none twice: their document ranges tile the corpus, and (MLM-only packing keeps every token of every
document) their tokens are the single prepare's tokens. Each share records its peak memory; the
three NSP shares, each prepared by its own ``bert-mp prepare`` process, train.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import forkserver
import pytest
from support import make_tokenizer

from bert_mp.core.config import load_config
from bert_mp.data.prepare import cache_path, load_prepared, load_prepared_shares, prepare
from bert_mp.data.prepare.read import share_range
from bert_mp.errors import ConfigError, DataError

SPECIAL_IDS = set(range(5))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    rng = random.Random(3)
    docs = [
        " ".join(" ".join(f"w{rng.randrange(59)}" for _ in range(rng.randint(4, 12))) + "." for _ in range(3))
        for _ in range(100)
    ]
    (root / "a.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    make_tokenizer().save_pretrained(str(root / "tok"))
    return root


def _data(root: Path, *extra: str) -> list[str]:
    return [
        "data.source=text",
        f"data.paths=[{root / 'a.txt'}]",
        "data.max_seq_length=32",
        "data.validation_fraction=0.1",
        *extra,
    ]


def _tokens(folder: Path) -> Counter:
    ds = load_prepared(folder).dataset
    return Counter(
        t
        for split in ("train", "validation")
        for row in ds[split]["input_ids"]
        for t in row
        if t not in SPECIAL_IDS
    )


def test_shares_cut_as_datasets_cuts_and_tile_the_corpus():
    from datasets import Dataset

    ds = Dataset.from_dict({"i": list(range(10))})
    for n in (1, 3, 4, 10):
        ranges = [share_range(10, i, n) for i in range(n)]
        assert [list(range(*r)) for r in ranges] == [ds.shard(n, i, contiguous=True)["i"] for i in range(n)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 10
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_three_shares_hold_exactly_the_documents_of_one_prepare(corpus):
    """objective=mlm packs every token of every document once: the shares' tokens are the whole's."""
    whole = prepare(load_config(None, _data(corpus, "data.objective=mlm", f"data.cache_dir={corpus}/whole")))
    tokenizer = f"data.tokenizer={whole / 'tokenizer'}"  # trained once, on the whole corpus
    mlm = ("data.objective=mlm", f"data.cache_dir={corpus}/mlm", tokenizer)
    shares = [prepare(load_config(None, _data(corpus, *mlm, f"data.shard={i}/3"))) for i in range(3)]
    whole_stats = json.loads((whole / "stats.json").read_text())
    ranges = [json.loads((s / "stats.json").read_text())["shard"] for s in shares]
    n = whole_stats["documents"]["documents_kept"]
    assert [r["documents"] for r in ranges] == [list(share_range(n, i, 3)) for i in range(3)]
    assert all(r["corpus_documents"] == n and r["count"] == 3 for r in ranges)
    together = sum((_tokens(s) for s in shares), Counter())
    assert together == _tokens(whole)  # every document's tokens once: none missing, none twice
    assert json.loads((shares[0] / "stats.json").read_text())["memory"]["peak_rss_bytes"] > 0


def test_three_nsp_shares_prepared_by_three_processes_train_together(corpus):
    tokenizer = str(corpus / "tok")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    folders, memory = [], []
    for i in range(3):  # each share by its own process, as each machine of a Slurm array would
        args = _data(corpus, "data.cache_dir=nsp_shares", f"data.tokenizer={tokenizer}", f"data.shard={i}/3")
        proc = forkserver.run(
            [sys.executable, "-m", "bert_mp", "prepare", *args],
            cwd=corpus,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"data.shard={i}/3: documents " in proc.stdout
        folder = cache_path(load_config(None, args).data)
        folders.append(folder)
        memory.append(json.loads((corpus / folder / "stats.json").read_text())["memory"]["peak_rss_bytes"])
    assert len(set(folders)) == 3 and all(m > 0 for m in memory)
    train = [
        *_data(corpus, f"data.tokenizer={tokenizer}"),
        f"train.prepared=['{corpus / 'nsp_shares'}/[0-9a-f]*']",  # a glob (quoted: brackets): the three shares
        "model.hidden_size=32",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.max_steps=2",
        "train.progress_bar=false",
        "train.output_dir=run",
    ]
    proc = forkserver.run(
        [sys.executable, "-m", "bert_mp", "train", *train],
        cwd=corpus,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((corpus / "run" / "summary.json").read_text())
    splits = [
        json.loads((corpus / f / "stats.json").read_text())["per_split"]["train"]["examples"] for f in folders
    ]
    assert summary["status"] == "completed" and summary["data"]["train_examples"] == sum(splits)


def test_shares_that_differ_in_a_setting_or_repeat_are_one_line(corpus):
    tok, odd = f"data.tokenizer={corpus / 'tok'}", f"data.cache_dir={corpus}/odd"
    a = prepare(load_config(None, _data(corpus, odd, tok, "data.shard=0/2")))
    b = prepare(load_config(None, _data(corpus, odd, tok, "data.shard=1/2", "data.max_seq_length=64")))
    run = load_config(None, _data(corpus, tok)).data
    with pytest.raises(DataError, match=r"was prepared with data.max_seq_length=64, this run has 32"):
        load_prepared_shares([str(a), str(b)], run)
    with pytest.raises(DataError, match="share 0/2 is named twice"):
        load_prepared_shares([str(a), str(shutil.copytree(a, corpus / "copy_of_0_2"))], run)
    with pytest.warns(UserWarning, match=r"share 1/2 not given"):
        load_prepared_shares([str(a)], run)
    with pytest.raises(ConfigError, match=r"data.shard='3/3': give I/N"):
        load_config(None, _data(corpus, "data.shard=3/3", tok))
