"""Golden rows: the bytes `bert-mp prepare` writes for fixed corpora and a fixed tokenizer.

Speed work on the pipeline must leave these hashes unchanged. A change of semantics (what a
document, a sentence or an example is) changes them on purpose: update the hash in the same commit
and say why there.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pyarrow as pa
import pytest
from support import FIXED_WORDS as WORDS  # the digests below were recorded with these words

from bert_mp.core.config import load_config
from bert_mp.data import prepare as prep


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice([".", ".", "?", "!"])


def corpus_text(shape: str) -> str:
    """Small corpora of the shapes the pipeline meets (seeded: the same text on every run)."""
    rng = random.Random(shape)
    if shape == "mixed":  # 1-10 sentences per document
        docs = [" ".join(_sentence(rng, 3, 18) for _ in range(rng.randint(1, 10))) for _ in range(150)]
    elif shape == "short":  # many documents of one or two short sentences
        docs = [" ".join(_sentence(rng, 3, 12) for _ in range(rng.randint(1, 2))) for _ in range(600)]
    elif shape == "long":  # few documents, one with sentences longer than an example
        docs = [" ".join(_sentence(rng, 3, 18) for _ in range(120)) for _ in range(3)]
        docs.append(" ".join([_sentence(rng, 60, 80), _sentence(rng, 3, 9), _sentence(rng, 50, 52)]))
    else:
        raise ValueError(shape)
    return "\n\n".join(docs) + "\n"


CASES = {
    "mixed": ("mixed", ()),
    "mixed-static-dupe": ("mixed", ("data.masking=static", "data.dupe_factor=2")),
    "short": ("short", ()),
    "long-wwm-static": ("long", ("data.masking=static", "data.whole_word_masking=true")),
}

GOLDEN = {
    "mixed": "97bf522c1468457eb04608800e079906a236c342ea0e00dc5033044ab6040fe2",
    "mixed-static-dupe": "811e799893f766afb719eb2af50f9c4e0ffbfab91d832522fb88cd0ad3c34aee",
    "short": "6e21f46195e1e2a962c5773f9bb181fd86a697b799df46e134f8b41aa5aa8c36",
    "long-wwm-static": "f30f82c56e9a1e9d9700edf0d2f3a167ffc30ac08475d5bfe3edaa5fa4722cda",
}


def rows_digest(path: Path) -> str:
    """sha256 over both splits: every column's name, type and values in row order."""
    data = prep.load_prepared(path).dataset
    h = hashlib.sha256()
    for split in ("train", "validation"):
        table: pa.Table = data[split].data.table
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            h.update(f"{split}/{name}/{col.type}/{len(col)}".encode())
            h.update(repr(col.to_pylist()).encode())
    return h.hexdigest()


def prepare_case(tmp: Path, tokenizer: Path, shape: str, extra: tuple, num_proc: int = 1) -> Path:
    corpus = tmp / f"{shape}.txt"
    if not corpus.exists():
        tmp.mkdir(parents=True, exist_ok=True)
        corpus.write_text(corpus_text(shape), encoding="utf-8")
    cfg = load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{corpus}]",
            f"data.tokenizer={tokenizer}",
            "data.max_seq_length=48",
            "data.validation_fraction=0.1",
            "data.pairing_block_chars=4000",
            f"data.num_proc={num_proc}",
            f"data.cache_dir={tmp / 'cache'}",
            *extra,
        ],
    )
    return prep.prepare(cfg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_match_the_golden_digest(tmp_path, tokenizer_dir, case):
    shape, extra = CASES[case]
    digest = rows_digest(prepare_case(tmp_path, tokenizer_dir, shape, extra))
    assert digest == GOLDEN[case], f"{case}: rows changed (digest {digest})"
