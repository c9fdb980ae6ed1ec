"""The ``data`` section: what ``bert-mp prepare`` does, and the cache key of its output."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from bert_mp.core.config.checks import _check, _choice, _range

DOCUMENT_MODES = ("blank_line", "file", "line")
OBJECTIVES = ("nsp", "mlm")


@dataclass
class DataConfig:
    """Corpus, tokenizer, NSP pairing and MLM masking: everything ``bert-mp prepare`` does."""

    source: str = "builtin"
    """Corpus source: builtin (stdlib docstrings + pydoc topics, offline), text, jsonl, csv, parquet, hub."""
    paths: list[str] = field(default_factory=list)
    """Files or glob patterns for local sources (text: what a document is, see ``documents``)."""
    documents: str = "blank_line"
    """What a document is in a text file: ``blank_line`` (text between blank lines), ``file`` (the
    whole file: books, articles) or ``line`` (Google's create_pretraining_data format: one sentence
    per line, a blank line between documents; lines are the sentences, not re-split)."""
    dedupe: bool = False
    """Drop exact duplicate documents (same text after stripping whitespace; the first is kept)."""
    text_column: str = "text"
    """Column holding the text for jsonl / csv / parquet / hub sources."""
    hub_name: Optional[str] = None
    """Hugging Face Hub dataset name for source=hub (e.g. ``wikitext``)."""
    hub_config: Optional[str] = None
    """Hub dataset configuration name (e.g. ``wikitext-103-raw-v1``)."""
    hub_split: str = "train"
    """Hub split to read."""
    streaming: bool = False
    """Stream the Hub dataset instead of downloading it whole (for corpora larger than the disk)."""
    encoding_errors: str = "replace"
    """Invalid UTF-8 bytes: ``replace`` (U+FFFD, counted in stats) or ``strict`` (stop with an error)."""
    max_documents: Optional[int] = None
    """Read at most this many documents (None: all)."""
    validation_fraction: float = 0.02
    """Share of documents held out for the validation split (split by document, never by pair)."""

    tokenizer: Optional[str] = None
    """None: train a WordPiece tokenizer on the corpus. Otherwise a Hub name or local path."""
    vocab_size: int = 8192
    """Vocabulary size when training a tokenizer."""
    lowercase: bool = True
    """Lowercase (uncased BERT) when training a tokenizer."""
    vocab_sample_chars: Optional[int] = 50_000_000
    """When training a tokenizer: characters of training documents its vocabulary is learned from, a
    sample drawn across the whole corpus from ``seed`` (every stretch of it contributes; the same
    documents on every run and for every ``shard``), or every training document when they hold fewer.
    None: the whole corpus, however large (training time grows with it). See docs/data.md."""
    sentence_splitter: str = "rule"
    """Sentence splitter: ``rule`` (fast, built in) or ``nltk`` / ``blingfire`` when installed."""

    objective: str = "nsp"
    """``nsp``: sentence pairs ``[CLS] A [SEP] B [SEP]`` with next-sentence labels, trained with the
    MLM and NSP heads (BERT). ``mlm``: contiguous text packed into full-length ``[CLS] ... [SEP]``
    sequences, documents separated by [SEP], no NSP labels; only the MLM loss is trained (RoBERTa's
    FULL-SENTENCES, ``run_mlm.py``'s ``group_texts``)."""
    max_seq_length: int = 128
    """Tokens per example including [CLS] and [SEP]s."""
    short_seq_prob: float = 0.1
    """Probability of a shorter random target length (BERT reference: 0.1)."""
    nsp_random_prob: float = 0.5
    """Probability that B is a random sentence from another document."""
    dupe_factor: int = 1
    """Repeat the pairing pass this many times with different randomness (objective=nsp only)."""
    pairing_block_chars: int = 2_000_000
    """Documents are paired in blocks of about this many characters; a random B comes from another
    document of the same block (bounded memory, and the output does not depend on num_proc)."""

    masking: str = "dynamic"
    """``dynamic`` (masked by the collator at load time, new mask every epoch) or ``static`` (masked once)."""
    mlm_probability: float = 0.15
    """Share of non-special tokens selected for prediction."""
    mask_token_prob: float = 0.8
    """Of the selected tokens: share replaced with [MASK]."""
    random_token_prob: float = 0.1
    """Of the selected tokens: share replaced with a random regular token (the rest stay unchanged)."""
    max_predictions_per_seq: Optional[int] = None
    """Cap on masked positions per sequence. None: what ``mlm_probability`` of ``max_seq_length``
    needs (20 at 128, 77 at 512); a smaller cap masks less than ``mlm_probability`` and warns."""
    whole_word_masking: bool = False
    """Mask whole words (a token and its ## continuations) together."""
    pack_pairs: bool = False
    """Put several examples into one row of ``max_seq_length`` at load time (first fit, per micro-batch):
    each attends only within itself, with its own position ids and NSP at its own [CLS]. Needs
    model.unpad=true; the prepared data is the same (not part of the cache key). See docs/training.md."""
    token_budget: bool = False
    """Micro-batches of a fixed token budget: every micro-batch is ``train.micro_batch_size`` rows of
    ``max_seq_length`` tokens, filled first-fit with whole examples in data order; the example that
    does not fit starts the next micro-batch (carried, never dropped, never cut in two). One input
    shape every step, so a compiled run compiles once; each example attends only within itself (a
    block-diagonal mask, or torch's varlen kernel on CUDA), with its own position ids and NSP at its
    own [CLS]. ``train.global_batch_size`` then counts rows. Not with model.unpad or data.pack_pairs;
    not part of the cache key. See docs/training.md."""
    mlm_document_attention: str = "cross"
    """objective=mlm: ``cross`` lets a token attend across the [SEP] between two documents of a row
    (RoBERTa's FULL-SENTENCES, as prepared); ``block`` keeps each document of a row to itself, with
    its own position ids (like DOC-SENTENCES). Needs model.unpad=true; not part of the cache key."""

    seed: int = 12345
    """Seed for every random choice in data preparation and masking."""
    num_proc: int = 1
    """Processes that read and pair the corpus in ``prepare``; the output is identical for any value."""
    num_shards: int = 1
    """Shards per split written by ``save_to_disk``."""
    cache_dir: str = "runs/data"
    """Prepared data goes to ``<cache_dir>/<hash of this section>/``; the same config reuses it."""
    build_wait_s: Optional[float] = None
    """How long a ``prepare`` (or a ``train`` that prepares) waits for another process building the
    same folder before it stops with one line (exit 2); None: as long as that build takes. The
    waiting command then reuses what the other one built."""
    shard: str = "0/1"
    """``I/N``: prepare share I (0 to N-1) of the corpus's documents cut into N contiguous shares
    (``datasets``' ``Dataset.shard(N, I, contiguous=True)``), into its own folder, so that N machines
    prepare one corpus at the same time; ``bert-mp train`` takes the N folders (``train.prepared``).
    Without ``data.tokenizer`` every share learns the same vocabulary, from the whole corpus's sample
    (``vocab_sample_chars``); NSP's random B and data.dedupe stay within a share. 0/1: the whole corpus."""

    def validate(self) -> None:
        _choice(self.source, "data.source", ("builtin", "text", "jsonl", "csv", "parquet", "hub"))
        if self.source in ("text", "jsonl", "csv", "parquet"):
            _check(
                len(self.paths) > 0, "data.paths", f"source={self.source} needs at least one path", self.paths
            )
        if self.source == "hub":
            _check(bool(self.hub_name), "data.hub_name", "source=hub needs a dataset name", self.hub_name)
        _choice(self.encoding_errors, "data.encoding_errors", ("replace", "strict"))
        _choice(self.sentence_splitter, "data.sentence_splitter", ("rule", "nltk", "blingfire"))
        _choice(self.masking, "data.masking", ("dynamic", "static"))
        _choice(self.documents, "data.documents", DOCUMENT_MODES)
        if self.documents != "blank_line":
            _check(
                self.source == "text",
                "data.documents",
                f"documents={self.documents} applies to source=text (source is {self.source})",
                self.documents,
            )
        if self.documents == "line":
            _check(
                self.sentence_splitter == "rule",
                "data.sentence_splitter",
                "documents=line takes every line as a sentence; leave the splitter at rule",
                self.sentence_splitter,
            )
        _choice(self.objective, "data.objective", OBJECTIVES)
        _choice(self.mlm_document_attention, "data.mlm_document_attention", ("cross", "block"))
        if self.mlm_document_attention == "block":
            _check(
                self.objective == "mlm",
                "data.mlm_document_attention",
                "block applies to objective=mlm rows (an NSP pair is one example, not two documents)",
                self.mlm_document_attention,
            )
        _range(self.max_seq_length, "data.max_seq_length", 8, 512)
        _range(self.vocab_size, "data.vocab_size", 64, 1_000_000)
        _range(self.short_seq_prob, "data.short_seq_prob", 0.0, 1.0)
        _range(self.nsp_random_prob, "data.nsp_random_prob", 0.0, 1.0)
        _range(self.dupe_factor, "data.dupe_factor", 1)
        if self.objective == "mlm":
            _check(
                self.dupe_factor == 1,
                "data.dupe_factor",
                "objective=mlm packs the text once; train more epochs instead (dynamic masking "
                "gives new masks every epoch)",
                self.dupe_factor,
            )
        _range(self.pairing_block_chars, "data.pairing_block_chars", 1000)
        _range(self.mlm_probability, "data.mlm_probability", 0.0, 1.0)
        _check(self.mlm_probability > 0, "data.mlm_probability", "must be > 0", self.mlm_probability)
        _range(self.mask_token_prob, "data.mask_token_prob", 0.0, 1.0)
        _range(self.random_token_prob, "data.random_token_prob", 0.0, 1.0)
        _check(
            self.mask_token_prob + self.random_token_prob <= 1.0 + 1e-9,
            "data.random_token_prob",
            "mask_token_prob + random_token_prob must be <= 1",
            self.random_token_prob,
        )
        if self.max_predictions_per_seq is not None:
            _range(self.max_predictions_per_seq, "data.max_predictions_per_seq", 1)
        _range(self.validation_fraction, "data.validation_fraction", 0.0, 0.5)
        _range(self.num_proc, "data.num_proc", 1, 256)
        if self.build_wait_s is not None:
            _range(self.build_wait_s, "data.build_wait_s", 0)
        _range(self.num_shards, "data.num_shards", 1)
        _range(self.seed, "data.seed", 0)
        if self.max_documents is not None:
            _range(self.max_documents, "data.max_documents", 1)
        if self.vocab_sample_chars is not None:
            _range(self.vocab_sample_chars, "data.vocab_sample_chars", 1)
        self.shard_parts()

    def shard_parts(self) -> tuple[int, int]:
        """``(I, N)`` of ``shard``; a malformed value is an error naming ``data.shard``."""
        from bert_mp.errors import ConfigError

        parts = str(self.shard).split("/")
        try:
            index, count = int(parts[0]), int(parts[1])
            if len(parts) != 2 or count < 1 or not 0 <= index < count:
                raise ValueError
        except (ValueError, IndexError):
            raise ConfigError(
                f"data.shard={self.shard!r}: give I/N with 0 <= I < N (e.g. 0/3, 1/3, 2/3; 0/1 is the whole corpus)"
            ) from None
        return index, count

    def masking_budget(self) -> int:
        """Masked positions a sequence of ``max_seq_length`` needs: ``ceil(p * max_seq_length)``."""
        return math.ceil(self.mlm_probability * self.max_seq_length - 1e-9)

    def max_predictions(self) -> int:
        """``max_predictions_per_seq``, or the masking budget when it is None."""
        if self.max_predictions_per_seq is None:
            return self.masking_budget()
        return self.max_predictions_per_seq

    def masking_cap_warning(self) -> str | None:
        """A warning when a set ``max_predictions_per_seq`` masks less than ``mlm_probability``."""
        need = self.masking_budget()
        cap = self.max_predictions_per_seq
        if cap is None or cap >= need:
            return None
        return (
            f"data.max_predictions_per_seq={cap} is below the {need} masked positions that "
            f"mlm_probability={self.mlm_probability} of max_seq_length={self.max_seq_length} needs: "
            f"full-length sequences get only ~{cap / self.max_seq_length:.1%} of tokens masked "
            "(leave it unset to derive it)"
        )

    def cache_key(self) -> str:
        """Hash of every setting that changes the prepared bytes (not num_proc, not cache_dir)."""
        d = asdict(self)
        for k in (
            "num_proc",
            "cache_dir",
            "build_wait_s",
            "pack_pairs",
            "token_budget",
            "mlm_document_attention",
        ):
            d.pop(k)
        if self.tokenizer is not None:  # a given tokenizer: no vocabulary is learned, no sample drawn
            d.pop("vocab_sample_chars")
        # a derived cap and the same cap set explicitly give the same bytes; defaults of the new
        # keys leave the key of an existing config unchanged
        d["max_predictions_per_seq"] = self.max_predictions()
        for k, default in (
            ("documents", "blank_line"),
            ("objective", "nsp"),
            ("dedupe", False),
            ("shard", "0/1"),
        ):
            if d[k] == default:
                d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
