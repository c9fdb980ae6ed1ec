"""`bert-mp prepare` at the edges, in this process: special tokens written in the text, the tokenizer
cache keyed by the training text, and the warnings on both splits (the same cases through the real
CLI: integration/test_prepare_edges_cli.py)."""

from __future__ import annotations

import hashlib
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support import LEXICON, SPECIALS, wordpiece_tokenizer
from transformers import AutoTokenizer

from bert_mp.core.config import DataConfig, load_config
from bert_mp.data import prepare as prep
from bert_mp.data.prepare import blocks as prep_blocks
from bert_mp.data.prepare import stats as prep_stats
from bert_mp.data.prepare import vocab as prep_vocab

LITERALS = ("[SEP]", "[MASK]", "[CLS]")


def _cfg(tmp_path: Path, paths: list[Path], *extra: str):
    return load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{','.join(str(p) for p in paths)}]",
            "data.vocab_size=300",
            "data.max_seq_length=48",
            "data.validation_fraction=0.1",
            "data.pairing_block_chars=3000",
            f"data.cache_dir={tmp_path / 'cache'}",
            *extra,
        ],
    )


def special_text_corpus(path: Path, lower: bool = False, n_docs: int = 60) -> dict[str, int]:
    """Documents of LEXICON sentences, some with a [SEP], [MASK] or [CLS] written inside a sentence
    (some of those with "|" too, the first inline marker: they take the [SEP] form); ``lower``:
    the same text with those written in lower case, which no tokenizer takes for a special token.
    Returns how often each special token is written."""
    rng = random.Random(7)
    docs, counts = [], dict.fromkeys(LITERALS, 0)
    for d in range(n_docs):
        sents = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(LEXICON) for _ in range(rng.randint(4, 12))]
            words[0] = words[0].capitalize()
            if rng.random() < 0.3:
                lit = rng.choice(LITERALS)
                counts[lit] += 1
                words.insert(rng.randint(1, len(words) - 1), lit.lower() if lower else lit)
            sents.append(" ".join(words) + ".")
        if d % 7 == 0:
            sents.append("A | b.")
        docs.append(" ".join(sents))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return counts


def _rows(path: Path) -> dict:
    return {s: prep.load_prepared(path).dataset[s].data.table for s in ("train", "validation")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A WordPiece tokenizer trained on the corpus with the special tokens written in it."""
    tmp = tmp_path_factory.mktemp("trained")
    special_text_corpus(tmp / "corpus.txt")
    return prep.prepare(_cfg(tmp, [tmp / "corpus.txt"])) / "tokenizer"


@pytest.mark.parametrize("objective", ["nsp", "mlm"])
@pytest.mark.parametrize("inline", [True, False], ids=["inline-markers", "sep-form-only"])
def test_special_tokens_written_in_the_text_are_tokenized_as_text(
    tmp_path, monkeypatch, trained, objective, inline
):
    """A [SEP] written in a document ends no sentence and separates no documents, a [MASK] is no
    mask: the rows are those of the same corpus with the tokens written in lower case (BERT
    lowercases text), and stats.json counts them."""
    markers = prep_blocks.inline_markers
    # inline: the markers of regular tokens only, so the documents holding "|", the one candidate in
    # this vocabulary, take the [SEP] form with the special tokens' text in it (not an [UNK] marker)
    known = lambda t, *a: [(c, m) for c, m in markers(t, *a) if m != t.unk_token_id]  # noqa: E731
    monkeypatch.setattr(prep_blocks, "inline_markers", known if inline else lambda *_: [])
    counts = special_text_corpus(tmp_path / "literal.txt")
    assert special_text_corpus(tmp_path / "lower.txt", lower=True) == counts
    extra = (f"data.tokenizer={trained}", f"data.objective={objective}")
    literal = prep.prepare(_cfg(tmp_path / "a", [tmp_path / "literal.txt"], *extra))
    lower = prep.prepare(_cfg(tmp_path / "b", [tmp_path / "lower.txt"], *extra))
    a, b = _rows(literal), _rows(lower)
    assert a["train"].num_rows > 20
    for split in a:
        assert a[split].equals(b[split]), split
    pd = prep.load_prepared(literal)
    tok = pd.tokenizer
    per_split = pd.stats["per_split"]
    found: dict[str, int] = {}
    for v in per_split.values():
        for k, n in v["special_tokens_in_text"].items():
            found[k] = found.get(k, 0) + n
    assert found == {k: n for k, n in counts.items() if n} and len(found) == 3
    assert prep.load_prepared(lower).stats["per_split"]["train"]["special_tokens_in_text"] == {}
    for split in ("train", "validation"):
        seps = 0
        for row in pd.dataset[split]:
            ids = np.array(row["input_ids"])
            assert (
                tok.mask_token_id not in ids
                and (ids == tok.cls_token_id).sum() == 1
                and ids[0] == tok.cls_token_id
            )
            at = np.flatnonzero(ids == tok.sep_token_id)
            seps += at.size
            if objective == "nsp":  # [CLS] A [SEP] B [SEP]: the two [SEP]s close A and B
                assert at.tolist() == [int((np.array(row["token_type_ids"]) == 0).sum()) - 1, ids.size - 1]
        if objective == "mlm":  # one [SEP] per row, one between consecutive documents of a block
            assert seps == pd.dataset[split].num_rows + per_split[split]["document_separators"]
    if objective == "nsp" and inline:  # the documents with "|" took the [SEP] form
        assert sum(v["sep_marked_documents"] for v in per_split.values()) == 9


def test_a_pairer_sent_to_a_spawned_worker_keeps_special_tokens_as_text(trained):
    cfg = load_config(None, [f"data.tokenizer={trained}"])
    pairer = prep_blocks.BlockPairer(None, AutoTokenizer.from_pretrained(trained), cfg.data)
    assert pairer.encoder.encode_special_tokens and pairer.ascii_encoder.encode_special_tokens
    sent = pickle.loads(pickle.dumps(pairer))
    assert sent.encoder.encode_special_tokens and sent.ascii_encoder.encode_special_tokens
    assert sent.ascii_encoder.encode("a [SEP] b").ids == sent.encoder.encode("a [SEP] b").ids


def _table(texts: list[str], chunk: int) -> pa.Table:
    return pa.Table.from_batches(
        [pa.RecordBatch.from_pydict({"text": texts[lo : lo + chunk]}) for lo in range(0, len(texts), chunk)]
    )


def test_training_text_digest_is_the_text_that_training_reads_only():
    texts = [f"doc {i} " + "é" * (i % 5) for i in range(50)]
    ids = np.arange(0, 50, 2)
    digest = prep.training_text_digest(_table(texts, 50), ids)
    # chunking (how many reader processes wrote the corpus) and slices do not matter
    assert prep.training_text_digest(_table(texts, 7), ids) == digest
    padded = _table(["x", *texts, "y"], 9).slice(1, 50)
    assert prep.training_text_digest(padded, ids) == digest
    empty_chunk = pa.Table.from_batches([pa.RecordBatch.from_pydict({"text": pa.array([], pa.string())})])
    assert prep.training_text_digest(pa.concat_tables([empty_chunk, _table(texts, 50)]), ids) == digest
    large = _table(texts, 13).cast(pa.schema([("text", pa.large_string())]))
    assert prep.training_text_digest(large, ids) == digest
    # a document that training does not read changes nothing (49 is not one); the text, where one
    # training document ends, and which documents train do
    assert prep.training_text_digest(_table([*texts[:-1], "other"], 50), ids) == digest
    assert prep.training_text_digest(_table(["other", *texts[1:]], 50), ids) != digest
    moved = [*texts[:10], texts[10] + texts[12][:1], texts[11], texts[12][1:], *texts[13:]]
    assert "".join(moved[10:13:2]) == "".join(texts[10:13:2])
    assert prep.training_text_digest(_table(moved, 50), ids) != digest
    assert prep.training_text_digest(_table(texts, 50), ids[1:]) != digest
    data = DataConfig()
    key = prep.tokenizer_cache_path(data, digest)
    assert key == prep.tokenizer_cache_path(DataConfig(max_seq_length=64, dedupe=True), digest)
    assert key != prep.tokenizer_cache_path(DataConfig(vocab_size=500), digest)
    assert key != prep.tokenizer_cache_path(data, digest[::-1])


def _deterministic_trainer(texts, vocab_size, lowercase=True, length=None, characters=None):
    """A stand-in for WordPiece training (fast) that makes the text it was trained on visible: a
    token naming the hash of the texts, then every word."""
    texts = [t for batch in (texts() if callable(texts) else texts) for t in batch]
    digest = hashlib.sha256(repr(texts).encode()).hexdigest()[:12]
    words = sorted({w for t in texts for w in re.findall(r"\w+", t.lower())})
    return wordpiece_tokenizer([*SPECIALS, f"input{digest}", *words, *".!?|"], bert_text=True)


def test_each_config_gets_the_tokenizer_of_its_own_training_text_whatever_ran_before(tmp_path, monkeypatch):
    """dedupe on/off x documents file/line read different training text: in any order, each config
    prepares with the tokenizer trained on its own text (the one it gets alone)."""
    monkeypatch.setattr(prep_vocab, "train_wordpiece", _deterministic_trainer)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, seed in (("a", 1), ("b", 2)):
        special_text_corpus(folder / f"{name}.txt", n_docs=25 + seed)
    (folder / "c.txt").write_text((folder / "a.txt").read_text())  # duplicates of every kind
    configs = [(d, m) for d in ("false", "true") for m in ("file", "line")]

    def run(cache: str, order: list) -> dict:
        out = {}
        for dedupe, mode in order:
            extra = (f"data.dedupe={dedupe}", f"data.documents={mode}", "data.validation_fraction=0.2")
            pd = prep.load_prepared(prep.prepare(_cfg(tmp_path / cache, [folder], *extra)))
            out[dedupe, mode] = pd.tokenizer.get_vocab()
        return out

    forward, backward = run("forward", configs), run("backward", configs[::-1])
    alone = {c: run(f"alone-{'-'.join(c)}", [c])[c] for c in configs}
    assert forward == backward == alone
    inputs = {next(t for t in v if t.startswith("input")) for v in alone.values()}
    assert len(inputs) == 4  # four different training texts, four tokenizers


def _split(documents: int, examples: int, random_share: float | None) -> dict:
    nsp = None
    if random_share is not None:
        nsp = {"random_share": random_share, "no_other_document": 0, "skipped_single_segment": 0}
        nsp["forced_random"] = 0
    return {"documents": documents, "examples": examples, "nsp": nsp}


@pytest.mark.parametrize(
    ("validation", "fraction", "want"),
    [
        (_split(1, 0, None), 0.02, "(1 document, 0 examples); raise data.validation_fraction (now 0.02"),
        (_split(1, 4, 0.0), 0.02, "(1 document, NSP random share 0.000); raise data.validation_fraction"),
        (_split(3, 40, 0.5), 0.05, "too small to evaluate NSP or MLM meaningfully (3 documents)"),
        (_split(30, 0, None), 0.02, "too small to evaluate MLM meaningfully (0 examples)"),
        (_split(30, 400, 0.9), 0.02, "NSP random share 0.900 (validation) is outside 0.45-0.55"),
        (_split(30, 400, 0.52), 0.02, None),
        (_split(1, 0, None), 0.0, None),  # no validation split asked for
    ],
)
def test_a_small_validation_split_is_flagged_with_the_key_that_fixes_it(validation, fraction, want):
    stats = {"per_split": {"train": _split(100, 1000, 0.5), "validation": validation}}
    got = prep_stats._validation_warning(stats, DataConfig(validation_fraction=fraction))
    assert got is None if want is None else want in got


def test_the_short_documents_warning_names_documents_file_for_text_files():
    split = _split(100, 1000, 0.8)
    split["nsp"]["forced_random"] = 700
    text = prep_stats._nsp_share_warning(split, "train", DataConfig(source="text", paths=["x"]))
    assert "data.documents=file reads each file as one document" in text
    jsonl = prep_stats._nsp_share_warning(split, "train", DataConfig(source="jsonl", paths=["x"]))
    assert "use longer documents" in jsonl and "data.documents" not in jsonl
    # the target is data.nsp_random_prob, not always 0.5
    assert (
        prep_stats._nsp_share_warning(_split(100, 1000, 0.0), "train", DataConfig(nsp_random_prob=0.0))
        is None
    )
    assert "outside 0.15-0.25" in prep_stats._nsp_share_warning(
        split, "train", DataConfig(nsp_random_prob=0.2)
    )


def test_the_summary_shows_truncated_tokens_as_a_share_of_the_corpus():
    stats = {
        "max_seq_length": 128,
        "dupe_factor": 1,
        "per_split": {
            "train": {"truncated_tokens": 250, "tokens": 900},
            "validation": {"truncated_tokens": 40, "tokens": 100},
        },
    }
    line = prep_stats._truncation_line(stats)
    assert (
        "truncated: 290 tokens cut from pairs to fit max_seq_length 128, 29.0% of the corpus's 1000 tokens"
        in line
    )
    stats["dupe_factor"] = 2
    assert (
        "14.5% of 2 passes (data.dupe_factor) over the corpus's 1000 tokens"
        in prep_stats._truncation_line(stats)
    )
