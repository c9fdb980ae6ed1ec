"""The prepare benchmark's scale mode (scripts/bench/prepare.py --mode scale) in parts, in this process: the generated corpus (the same on every
run, realistic document lengths, no duplicates) and one prepare and one tokenize-only measured the way
its children measure them, with the figures its summary reports (the whole script through its
children: integration/test_bench_scale.py, slow)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support import LEXICON, load_script

from bert_mp.data.whitespace import BLANK_LINES_RE


@pytest.fixture(scope="module")
def table():
    """Words with Zipf-like counts (counting the built-in corpus's words takes seconds)."""
    gen = load_script("bench/generated_text")
    return gen.word_table(" ".join(LEXICON[: k + 1]) for k in range(len(LEXICON)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, table):
    gen = load_script("bench/generated_text")
    folder = tmp_path_factory.mktemp("generated") / "corpus"
    files = gen.write_generated_corpus(folder, 300_000, seed=3, file_bytes=100_000, table=table)
    return folder, files


def test_the_generated_corpus_is_fixed_by_its_seed_with_no_duplicate_and_realistic_lengths(corpus, table):
    gen = load_script("bench/generated_text")
    folder, files = corpus
    record = gen.manifest(folder)
    assert len(files) == record["files"] == 3 and record["duplicate_documents"] == 0
    docs = [d for f in files for d in BLANK_LINES_RE.split(f.read_text()) if d.strip()]
    assert len(docs) == record["documents"] == len(set(docs))
    lengths = np.array([len(d) for d in docs])
    assert 1500 < lengths.mean() < 4000 and lengths.min() >= 80 and np.median(lengths) < lengths.mean()
    assert gen.file_text(3, 1, 100_000, table) == gen.file_text(3, 1, 100_000, table)
    assert gen.file_text(3, 1, 100_000, table) != gen.file_text(4, 1, 100_000, table)
    mtime = files[0].stat().st_mtime_ns
    assert gen.write_generated_corpus(folder, 300_000, seed=3, file_bytes=100_000, table=table) == files
    assert files[0].stat().st_mtime_ns == mtime


def test_a_prepare_and_a_tokenize_only_are_measured_alike_and_summarized(corpus, tmp_path):
    parts, scale = load_script("bench/prepare_parts"), load_script("bench/prepare")
    folder, files = corpus
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as the benchmark's children have it
    learned = parts.child_prepare([str(folder)], str(tmp_path / "cache"), ["data.vocab_size=300"])
    voc = learned["vocabulary"]
    assert voc["whole"] and set(voc["seconds"]) == {"sample", "alphabet", "train"}
    assert 0 < learned["vocabulary_share_of_wall"] < 1 and learned["memory_peaks_bytes"]["anon_total"] > 0
    tokenizer = os.path.join(learned["folder"], "tokenizer")
    given = parts.child_prepare([str(folder)], str(tmp_path / "cache"), [f"data.tokenizer={tokenizer}"])
    assert given["vocabulary"] is None and given["vocabulary_share_of_wall"] is None
    tok = parts.child_tokenize([str(f) for f in files], tokenizer, 1)
    assert tok["tokens"] == given["tokens"] > 0  # the same documents, the same tokens
    plain = parts.child_tokenize([str(f) for f in files], tokenizer, 1, plain_ascii_fast=True)
    assert plain["plain_ascii_fast"] and plain["tokens"] == tok["tokens"]  # prepare's encoders: the same ids
    trial = {"given": given, "tokenize": tok, "tokenize_same_malloc": tok, "tokenize_plain_ascii": plain}
    ratios = scale._ratios(trial)
    assert ratios["same_tokens"] and ratios["whole_same_malloc"] == ratios["whole"] > 0
    assert ratios["whole_vs_same_encoders"] == given["tokens_per_sec"] / plain["tokens_per_sec"]
    assert ratios["tokenize_stage"] > ratios["whole"]  # the stage is part of the whole
    report = {"learned": {"300KB": learned, "100KB": learned}, "trials": [{**trial, "ratios": ratios}]}
    summary = scale.summary(report, "300KB")
    assert summary["peak_anon_ratio_to_references"] == {"100KB": 1.0}
    assert summary["given_tokenizer_ratio_median"]["whole"] == ratios["whole"]
    json.dumps(summary)  # what the report writes


def test_trials_rotate_the_kinds():
    """The prepare benchmark orders a trial's measurements so that each kind runs first in turn."""
    rotated = load_script("bench/prepare_parts").rotated
    kinds = ["tokenize", "prepare", "tokenize-same-malloc"]
    orders = [rotated(kinds, r) for r in range(4)]
    assert orders == [
        ["tokenize", "prepare", "tokenize-same-malloc"],
        ["prepare", "tokenize-same-malloc", "tokenize"],
        ["tokenize-same-malloc", "tokenize", "prepare"],
        ["tokenize", "prepare", "tokenize-same-malloc"],
    ]
    assert rotated(["given", "tokenize"], 1) == ["tokenize", "given"] and rotated(["prepare"], 5) == [
        "prepare"
    ]


def test_every_command_the_docs_give_parses():
    """Each ``python scripts/bench/prepare.py ...`` the docs quote is a valid command of the script."""
    import re
    import shlex

    from support import ROOT

    parser = load_script("bench/prepare").parser()
    pages = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    commands = [
        c for page in pages for c in re.findall(r"scripts/bench/prepare\.py( --[^`\n]*)", page.read_text())
    ]
    assert len(commands) >= 5, commands
    for command in commands:
        args = parser.parse_args(shlex.split(command))
        assert args.mode in ("shapes", "scale"), command
