"""`bert-mp prepare` at the edges through the real CLI in a process of its own (tests/forkserver.py):
a line of Unicode whitespace is a blank line, the tokenizer cache gives each config the tokenizer
of its own training text whatever ran first, special tokens written in a corpus are text, and the
summary flags a validation split too small to evaluate, short documents and truncation (the pure
functions: unit/data/test_whitespace.py, unit/data/test_prepare_edges.py)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from support import LEXICON, run_cli

from bert_mp.data.prepare import assign_splits, load_prepared


def _prepare(tmp_path: Path, *args: str, cache: str = "cache"):
    """``bert-mp prepare ARGS`` in ``tmp_path``; the completed process and the prepared folder."""
    proc = run_cli("prepare", *args, f"data.cache_dir={tmp_path / cache}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, Path(re.search(r"^prepared .* -> (.+)$", proc.stdout, re.M).group(1))


def _warnings(proc) -> list[str]:
    return [line.split("warning: ", 1)[1] for line in proc.stdout.splitlines() if "  warning: " in line]


def test_a_line_holding_a_no_break_space_separates_documents_in_line_mode(tmp_path):
    (tmp_path / "g.txt").write_bytes(
        b"Alpha one two.\nBeta three four.\n\xc2\xa0\nGamma five six.\nDelta seven eight.\n\n"
        b"Epsilon nine ten.\nZeta eleven twelve.\n"
    )
    _, path = _prepare(
        tmp_path,
        "data.source=text",
        "data.paths=[g.txt]",
        "data.documents=line",
        "data.validation_fraction=0",
        "data.vocab_size=100",
        "data.max_seq_length=32",
        "data.nsp_random_prob=0",
    )
    pd = load_prepared(path)
    assert pd.stats["documents"]["documents_kept"] == 3
    assert pd.stats["per_split"]["train"]["sentences"] == 6
    docs = [
        {"alpha", "one", "two", "beta", "three", "four"},
        {"gamma", "five", "six", "delta", "seven", "eight"},
        {"epsilon", "nine", "ten", "zeta", "eleven", "twelve"},
    ]
    rows = list(pd.dataset["train"])
    assert len(rows) == 3
    for row in rows:  # every pair is a continuation inside one document
        words = set(pd.tokenizer.decode(row["input_ids"], skip_special_tokens=True).replace(".", " ").split())
        assert row["next_sentence_label"] == 0 and any(words <= d for d in docs), words


def test_a_line_holding_a_form_feed_or_a_no_break_space_ends_a_sentence_in_file_mode(tmp_path):
    (tmp_path / "a.txt").write_text(
        "alpha one two\n\f\nbeta three four\n\u00a0\ngamma five six\n\u3000 \t\ndelta seven eight\n",
        encoding="utf-8",
    )
    (tmp_path / "b.txt").write_text("epsilon nine ten\n\nzeta eleven twelve\n", encoding="utf-8")
    _, path = _prepare(
        tmp_path,
        "data.source=text",
        "data.paths=[a.txt,b.txt]",
        "data.documents=file",
        "data.validation_fraction=0",
        "data.vocab_size=100",
        "data.max_seq_length=32",
    )
    train = json.loads((path / "stats.json").read_text())["per_split"]["train"]
    assert (train["documents"], train["sentences"]) == (2, 6)


def test_each_config_gets_the_tokenizer_trained_on_its_own_text_in_either_order(tmp_path):
    """data.dedupe=false trains on a document repeated 200 times, whose words then become tokens;
    data.dedupe=true trains on it once, and they do not: in either order, each config's tokenizer
    is its own (before, the second config reused the first one's)."""
    rng = random.Random(3)
    docs = []
    for _ in range(80):
        sents = [
            " ".join(rng.choice(LEXICON) for _ in range(rng.randint(3, 18)))
            for _ in range(rng.randint(1, 10))
        ]
        docs.append(". ".join(s.capitalize() for s in sents) + ".")
    docs += ["Zyzzyva quokka xylophone jubjub."] * 200
    (tmp_path / "c.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    common = ("data.source=text", "data.paths=[c.txt]", "data.vocab_size=150", "data.validation_fraction=0")
    where = {}
    for order in (("false", "true"), ("true", "false")):
        for dedupe in order:
            proc, path = _prepare(tmp_path, *common, f"data.dedupe={dedupe}", cache=f"cache-{order[0]}-first")
            vocab = load_prepared(path).tokenizer.get_vocab()
            assert all((w in vocab) == (dedupe == "false") for w in ("zyzzyva", "quokka", "jubjub")), (
                order,
                dedupe,
            )
            kept = json.loads((path / "stats.json").read_text())["tokenizer"]
            where.setdefault(dedupe, set()).add(Path(kept.split("kept in ")[1].rstrip(")")).name)
    assert len(where["false"]) == len(where["true"]) == 1 and where["false"] != where["true"]


def _special_text_corpus(path: Path, lower: bool) -> None:
    """Documents with [SEP], [MASK] and [CLS] written inside sentences (``lower``: in lower case)."""
    rng = random.Random(11)
    docs = []
    for d in range(40):
        sents = []
        for s in range(rng.randint(2, 5)):
            words = [rng.choice(LEXICON) for _ in range(rng.randint(4, 10))]
            if (d + s) % 3 == 0:
                lit = ("[SEP]", "[MASK]", "[CLS]")[(d + s) % 9 // 3]
                words.insert(2, lit.lower() if lower else lit)
            sents.append(words[0].capitalize() + " " + " ".join(words[1:]) + ".")
        docs.append(" ".join(sents))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")


@pytest.mark.parametrize("objective", ["nsp", "mlm"])
def test_special_tokens_written_in_the_corpus_are_tokenized_as_text_and_counted(tmp_path, objective):
    _special_text_corpus(tmp_path / "literal.txt", lower=False)
    _special_text_corpus(tmp_path / "lower.txt", lower=True)
    text = (tmp_path / "literal.txt").read_text()
    written = {t: text.count(t) for t in ("[CLS]", "[MASK]", "[SEP]")}
    assert all(written.values())
    common = (
        "data.source=text",
        "data.vocab_size=200",
        "data.max_seq_length=32",
        f"data.objective={objective}",
    )
    proc, literal = _prepare(tmp_path, *common, "data.paths=[literal.txt]", cache="a")
    pd = load_prepared(literal)
    counted: dict[str, int] = {}
    for v in pd.stats["per_split"].values():
        for k, n in v["special_tokens_in_text"].items():
            counted[k] = counted.get(k, 0) + n
    assert counted == written
    shown = ", ".join(f"{k} {n}" for k, n in sorted(written.items()))
    assert f"special tokens written in the text (tokenized as text, not as specials): {shown}" in proc.stdout
    tok = pd.tokenizer
    for split in ("train", "validation"):
        ds = pd.dataset[split]
        ids = [np.array(r) for r in ds["input_ids"]]
        assert not any(tok.mask_token_id in r for r in ids)  # a [MASK] in the text is no mask
        seps = sum(int((r == tok.sep_token_id).sum()) for r in ids)
        # a [SEP] in the text ends no sentence (nsp: two per row) and separates no documents (mlm)
        extra = pd.stats["per_split"][split].get("document_separators", len(ids))
        assert seps == len(ids) + extra
    # the rows are those of the same corpus with the tokens written in lower case (BERT lowercases)
    _, lower = _prepare(
        tmp_path, *common, "data.paths=[lower.txt]", f"data.tokenizer={literal / 'tokenizer'}", cache="b"
    )
    for split in ("train", "validation"):
        assert pd.dataset[split].data.table.equals(load_prepared(lower).dataset[split].data.table), split


def _validation_corpus(tmp_path: Path, n_docs: int, n_val: int, val_sentences: int) -> str:
    """A corpus whose validation split (by data.seed's hash) is ``n_val`` documents of
    ``val_sentences`` sentences; returns the validation_fraction that gives it."""
    fraction = next(
        f for f in np.linspace(0.001, 0.5, 2000) if assign_splits(n_docs, f, 12345).sum() == n_val
    )
    val = assign_splits(n_docs, fraction, 12345)
    rng = random.Random(5)
    docs = []
    for i in range(n_docs):
        n = val_sentences if val[i] else rng.randint(3, 8)
        docs.append(
            " ".join(
                f"{rng.choice(LEXICON).capitalize()} {rng.choice(LEXICON)} {rng.choice(LEXICON)}."
                for _ in range(n)
            )
        )
    (tmp_path / "v.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return f"{fraction:.6f}"


@pytest.mark.parametrize(
    ("n_val", "val_sentences", "want"),
    [
        (1, 1, "(1 document, 0 examples)"),  # one single-sentence document: no pair at all
        (1, 6, "(1 document, NSP random share 0.000)"),  # one document: no random B, all continuations
        (3, 6, "(3 documents"),
    ],
)
def test_a_validation_split_too_small_to_evaluate_is_flagged_with_the_key(
    tmp_path, n_val, val_sentences, want
):
    fraction = _validation_corpus(tmp_path, 40, n_val, val_sentences)
    proc, path = _prepare(
        tmp_path,
        "data.source=text",
        "data.paths=[v.txt]",
        "data.vocab_size=150",
        "data.max_seq_length=32",
        f"data.validation_fraction={fraction}",
    )
    stats = json.loads((path / "stats.json").read_text())
    assert stats["per_split"]["validation"]["documents"] == n_val
    line = next(w for w in _warnings(proc) if "validation split" in w)
    assert line.startswith("the validation split is too small to evaluate NSP or MLM meaningfully")
    assert want in line and f"raise data.validation_fraction (now {float(fraction)}" in line
    assert line in stats["warnings"]


def test_short_documents_warning_names_documents_file_and_the_summary_shows_truncation(tmp_path):
    """Verse as paragraphs: one-sentence documents force a random B, and the warning names the key
    that reads each file as one document; with it the balance is right. Long sentences are cut to
    fit, and the summary says how much of the corpus that was."""
    rng = random.Random(9)
    for f in range(4):
        lengths = [rng.randint(30, 40) if i % 5 == 0 else rng.randint(3, 12) for i in range(40)]
        stanzas = [" ".join(rng.choice(LEXICON) for _ in range(n)) + "." for n in lengths]
        (tmp_path / f"book{f}.txt").write_text("\n\n".join(stanzas) + "\n", encoding="utf-8")
    common = ("data.source=text", "data.paths=[book*.txt]", "data.vocab_size=150", "data.max_seq_length=32")
    proc, path = _prepare(tmp_path, *common)
    stats = json.loads((path / "stats.json").read_text())
    share_warning = next(w for w in _warnings(proc) if w.startswith("NSP random share"))
    assert (
        "(train)" in share_warning and "data.documents=file reads each file as one document" in share_warning
    )
    cut = sum(v["truncated_tokens"] for v in stats["per_split"].values())
    tokens = sum(v["tokens"] for v in stats["per_split"].values())
    assert cut > 0 and stats["per_split"]["train"]["truncated_share"] > 0
    assert (
        f"truncated: {cut} tokens cut from pairs to fit max_seq_length 32, {cut / tokens:.1%} of the corpus's "
        f"{tokens} tokens" in proc.stdout
    )
    proc, path = _prepare(
        tmp_path, *common, "data.documents=file", "data.validation_fraction=0", cache="files"
    )
    assert 0.45 <= json.loads((path / "stats.json").read_text())["nsp_random_share"] <= 0.55
    assert not any(w.startswith("NSP random share") for w in _warnings(proc))
