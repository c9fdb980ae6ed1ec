"""``bert-mp prepare``: raw text -> NSP + MLM pretraining data, cached by the data-config hash.

Stages: read the corpus into an Arrow-backed ``Dataset`` (a generator, so memory stays bounded);
assign documents to train/validation by a hash of (seed, document index); train or load the
tokenizer; then each *block* of documents, in this process or in a pool of ``num_proc`` workers,
has its sentences split, every document of the block tokenized (256 per ``encode_batch_fast``
call), its documents paired (random B from another document of the block) and, in static mode,
its examples masked. A block is a fixed set of documents keyed by
global index and all randomness derives from (seed, split, dupe, block index), so the rows are
byte-identical for any ``num_proc``. The result is built in a temporary folder and renamed into
``<cache_dir>/<cache_key>/`` with a ``PREPARED`` marker written last; a crash never leaves a cache
that would be reused.

The stages are modules: :mod:`.cache` (the folder on disk: what training and export import),
:mod:`.read` (the corpus into Arrow), :mod:`.blocks` (splits, blocks, pairing), :mod:`.vocab` (the
tokenizer), :mod:`.pool` (the pairing workers), :mod:`.stats` (``stats.json`` and the summary),
:mod:`.interrupts` (Ctrl-C and SIGTERM: one line, no worker left behind) and :mod:`.build` (the
command).
"""

from __future__ import annotations

from bert_mp.data.prepare.blocks import assign_splits, make_blocks, take_column, take_texts
from bert_mp.data.prepare.build import command, data_only, prepare
from bert_mp.data.prepare.cache import (
    SPLITS,
    PreparedData,
    cache_path,
    is_complete,
    load_prepared,
    load_prepared_shares,
)
from bert_mp.data.prepare.read import first_occurrences
from bert_mp.data.prepare.stats import print_summary
from bert_mp.data.prepare.vocab import tokenizer_cache_path, training_text_digest

__all__ = [
    "SPLITS",
    "PreparedData",
    "assign_splits",
    "cache_path",
    "command",
    "data_only",
    "first_occurrences",
    "is_complete",
    "load_prepared",
    "load_prepared_shares",
    "make_blocks",
    "prepare",
    "print_summary",
    "take_column",
    "take_texts",
    "tokenizer_cache_path",
    "training_text_digest",
]
