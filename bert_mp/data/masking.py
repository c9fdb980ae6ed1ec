"""MLM masking: pure functions of (token ids, rng), and the collator that pads and masks at load time.

Every random choice comes from a generator derived from ``(seed, stream, epoch, index)`` with
:func:`derive_rng`, so an example is masked identically whatever the batch, worker, rank or resume
point it is seen in.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bert_mp.core.config import DataConfig

if TYPE_CHECKING:
    import torch

STREAM_MASKING = 1
"""Stream tag of every masking draw under ``data.seed`` (:func:`derive_rng`). Pairing seeds its own
``random.Random`` per block and the split assignment hashes with its own tag (data/prepare/blocks.py)."""

_PLACEHOLDER = re.compile(r"^(\[unused\d+\]|<unused\d+>|\[[A-Z_]+\]|<[a-z_]+>)$")


def derive_rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on ``(seed, stream, *keys)`` - never on global state."""
    entropy = [int(seed) % 2**64, int(stream), *(int(k) % 2**64 for k in keys)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def num_to_mask(num_candidates: int, mlm_probability: float, max_predictions: int) -> int:
    """``min(max_predictions, max(1, round(n * p)))``, or 0 when there is nothing to mask."""
    if num_candidates <= 0:
        return 0
    return min(max_predictions, max(1, round(num_candidates * mlm_probability)), num_candidates)


@dataclass(frozen=True)
class MaskingSpec:
    """What the masking functions need to know about the vocabulary and the ratios."""

    mask_token_id: int
    special: np.ndarray
    """bool per vocabulary id: never masked (CLS, SEP, PAD, UNK, MASK, ...)."""
    continuation: np.ndarray
    """bool per vocabulary id: a ``##`` word-piece that belongs to the previous token's word."""
    regular_ids: np.ndarray
    """Ids a random replacement may draw: not special, not an ``[unused]``/placeholder slot."""
    mlm_probability: float = 0.15
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1
    max_predictions: int = 20
    whole_word: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, data_cfg: DataConfig) -> MaskingSpec:
        """Build the spec from a Hugging Face tokenizer and the ``data`` config section."""
        if tokenizer.mask_token_id is None:
            raise ValueError("the tokenizer has no [MASK] token; MLM masking needs one")
        size = len(tokenizer)
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        special = np.zeros(size, dtype=bool)
        special[[i for i in tokenizer.all_special_ids if 0 <= i < size]] = True
        continuation = np.array([t is not None and t.startswith("##") for t in tokens], dtype=bool)
        placeholder = np.array([t is None or bool(_PLACEHOLDER.match(t)) for t in tokens], dtype=bool)
        regular_ids = np.flatnonzero(~special & ~placeholder)
        if regular_ids.size == 0:
            raise ValueError("the tokenizer has no regular tokens to draw random replacements from")
        return cls(
            mask_token_id=int(tokenizer.mask_token_id),
            special=special,
            continuation=continuation,
            regular_ids=regular_ids,
            mlm_probability=data_cfg.mlm_probability,
            mask_token_prob=data_cfg.mask_token_prob,
            random_token_prob=data_cfg.random_token_prob,
            max_predictions=data_cfg.max_predictions(),
            whole_word=data_cfg.whole_word_masking,
        )


def _choose_whole_words(ids: np.ndarray, cand: np.ndarray, num: int, spec: MaskingSpec, rng) -> np.ndarray:
    """Positions of randomly chosen whole words (a token plus its ``##`` continuations)."""
    starts = ~spec.continuation[ids[cand]]
    starts[0] = True
    starts[1:] |= np.diff(cand) != 1  # a continuation right after a special token starts its own word
    bounds = np.flatnonzero(starts).tolist() + [len(cand)]
    words = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    chosen: list[int] = []
    for w in rng.permutation(len(words)).tolist():
        lo, hi = words[w]
        if len(chosen) + (hi - lo) > num:
            continue  # the reference skips words that would overshoot the budget
        chosen.extend(range(lo, hi))
        if len(chosen) == num:
            break
    if not chosen:
        # Every word is longer than the budget: mask the first drawn one anyway (never zero masks).
        lo, hi = words[int(rng.integers(len(words)))]
        chosen = list(range(lo, hi))
    return cand[np.sort(np.asarray(chosen, dtype=np.int64))]


def mask_sequence(
    input_ids: Sequence[int] | np.ndarray, spec: MaskingSpec, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Mask one sequence; returns ``(masked input_ids, labels)`` with -100 where not masked.

    Exactly ``num_to_mask(n)`` of the ``n`` non-special tokens are chosen (whole-word masking may
    exceed it only when a single word is longer than the budget); of those, ``mask_token_prob``
    become ``[MASK]``, ``random_token_prob`` a random regular token, the rest stay unchanged.
    """
    ids = np.array(input_ids, dtype=np.int64)
    labels = np.full(ids.shape, -100, dtype=np.int64)
    cand = np.flatnonzero(~spec.special[ids])
    num = num_to_mask(cand.size, spec.mlm_probability, spec.max_predictions)
    if num == 0:
        return ids, labels
    if spec.whole_word:
        pos = _choose_whole_words(ids, cand, num, spec, rng)
    else:
        pos = np.sort(cand[rng.permutation(cand.size)[:num]])
    labels[pos] = ids[pos]
    r = rng.random(pos.size)
    replacements = spec.regular_ids[rng.integers(0, spec.regular_ids.size, size=pos.size)]
    to_mask = r < spec.mask_token_prob
    to_random = (r >= spec.mask_token_prob) & (r < spec.mask_token_prob + spec.random_token_prob)
    ids[pos[to_mask]] = spec.mask_token_id
    ids[pos[to_random]] = replacements[to_random]
    return ids, labels


def mask_example(
    input_ids: Sequence[int] | np.ndarray, spec: MaskingSpec, seed: int, epoch: int, index: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`mask_sequence` with the generator for ``(seed, epoch, index)``."""
    return mask_sequence(input_ids, spec, derive_rng(seed, STREAM_MASKING, epoch, index))


class PretrainingCollator:
    """Pads a list of features and, in dynamic mode, masks each one by ``(seed, epoch, index)``.

    Features are dicts with the prepared columns plus ``index`` (position in its split) and
    ``epoch``. Returns ``torch.long`` tensors ``input_ids``, ``token_type_ids``, ``attention_mask``,
    ``labels`` (-100 on unmasked and padding positions) and, when the features carry one (data
    prepared with ``objective=nsp``), ``next_sentence_label``; without it the model computes no NSP
    loss.
    """

    def __init__(
        self,
        tokenizer: Any,
        data_cfg: DataConfig,
        seed: int,
        pad_to_multiple_of: int | None = 8,
        pack_pairs: bool | None = None,
        layout: Any = None,
        budget_rows: int | None = None,
    ):
        warning = data_cfg.masking_cap_warning()
        if warning and data_cfg.masking == "dynamic":
            warnings.warn(warning, UserWarning, stacklevel=2)
        self.spec = MaskingSpec.from_tokenizer(tokenizer, data_cfg)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.dynamic = data_cfg.masking == "dynamic"
        self.seed = int(seed)
        self.pad_to_multiple_of = pad_to_multiple_of
        pack = data_cfg.pack_pairs if pack_pairs is None else pack_pairs
        self.pack_length = data_cfg.max_seq_length if pack else None
        """With ``data.pack_pairs``: examples share rows of this many tokens (``segment_ids`` tell them apart)."""
        block = data_cfg.objective == "mlm" and data_cfg.mlm_document_attention == "block"
        self.document_sep = int(tokenizer.sep_token_id) if block else None
        """With ``data.mlm_document_attention=block``: the [SEP] id that ends a document in a row
        (``segment_ids`` then number the documents of every row)."""
        self.static_length: Any = None
        """Under ``train.compile``: ``padded length -> length`` rounding to one of a few lengths
        (``bert_mp.model.buckets.collate_length``); packed batches then also keep one row per example."""
        self.budget_rows = budget_rows if data_cfg.token_budget else None
        """With ``data.token_budget``: every batch is this many rows of ``max_seq_length`` (the trainer's
        ``train.micro_batch_size``), the examples placed by ``data.packing.fill_rows``."""
        if data_cfg.token_budget and not budget_rows:
            raise ValueError("data.token_budget needs the collator's budget_rows (train.micro_batch_size)")
        self.max_length = data_cfg.max_seq_length
        self.layout = layout
        """None, or ``batch -> extra entries`` added to every collated batch: with ``model.unpad`` the
        trainer sets the unpadded model's host layout here (``unpad_layout``, moved to the device with
        the batch), so it is computed in the DataLoader (in a worker, while the device runs the previous
        step) rather than on the device."""

    def _example(self, f: dict[str, Any]) -> tuple[Any, Any]:
        """One feature's (masked input ids, labels)."""
        ids = f["input_ids"]
        if self.dynamic:
            if "index" not in f or "epoch" not in f:
                raise ValueError(
                    "dynamic masking needs 'index' and 'epoch' in every feature "
                    "(see docs/architecture.md, Collator)"
                )
            return mask_example(ids, self.spec, self.seed, int(f["epoch"]), int(f["index"]))
        if "labels" not in f:
            raise ValueError("static masking expects a 'labels' column; was the data prepared static?")
        return ids, f["labels"]

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("PretrainingCollator got an empty batch")
        if self.budget_rows:
            from bert_mp.data.rows import collate_rows

            return collate_rows(features, self._example, self.budget_rows, self.max_length, self.pad_token_id)
        batch = self._with_documents(self._packed(features) if self.pack_length else self._padded(features))
        return batch if self.layout is None else {**batch, **self.layout(batch)}

    def _padded(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """One row per example, padded to the longest (rounded up to ``pad_to_multiple_of``)."""
        import torch  # here, not at the top: `bert-mp prepare` imports this module and never needs torch

        length = max(len(f["input_ids"]) for f in features)
        length = self._padded_length(length)
        n = len(features)
        input_ids = np.full((n, length), self.pad_token_id, dtype=np.int64)
        token_type_ids = np.zeros((n, length), dtype=np.int64)
        attention_mask = np.zeros((n, length), dtype=np.int64)
        labels = np.full((n, length), -100, dtype=np.int64)
        with_nsp = "next_sentence_label" in features[0]
        nsp = np.zeros(n, dtype=np.int64)
        for row, f in enumerate(features):
            k = len(f["input_ids"])
            masked, lab = self._example(f)
            input_ids[row, :k] = masked
            labels[row, :k] = lab
            token_type_ids[row, :k] = f["token_type_ids"]
            attention_mask[row, :k] = 1
            if with_nsp:
                nsp[row] = int(f["next_sentence_label"])
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
        }
        if with_nsp:
            batch["next_sentence_label"] = torch.from_numpy(nsp)
        return batch

    def _padded_length(self, length: int) -> int:
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return length if self.static_length is None else int(self.static_length(length))

    def _with_documents(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``segment_ids`` per document of a row with ``data.mlm_document_attention=block`` (special
        tokens are never masked, so the masked ids show every [SEP])."""
        import torch

        if self.document_sep is None:
            return batch
        from bert_mp.data.packing import document_segments

        seg = batch.get("segment_ids")
        segments = document_segments(
            batch["input_ids"].numpy(),
            batch["attention_mask"].numpy(),
            self.document_sep,
            None if seg is None else seg.numpy(),
        )
        return {**batch, "segment_ids": torch.from_numpy(segments)}

    def _packed(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Examples first-fit into rows of ``pack_length``; ``segment_ids`` 1, 2, ... per example in a
        row (0 on padding). ``next_sentence_label`` follows the examples in row-major order, the order
        in which the unpadded model reads each example's ``[CLS]``."""
        import torch

        from bert_mp.data.packing import pack_rows

        plan = pack_rows([len(f["input_ids"]) for f in features], self.pack_length)
        length = max(sum(len(features[i]["input_ids"]) for i in row) for row in plan)
        length = self._padded_length(length)
        shape = (len(plan) if self.static_length is None else len(features), length)
        input_ids = np.full(shape, self.pad_token_id, dtype=np.int64)
        token_type_ids, attention_mask = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        segment_ids, labels = np.zeros(shape, dtype=np.int64), np.full(shape, -100, dtype=np.int64)
        order = [i for row in plan for i in row]
        for r, row in enumerate(plan):
            at = 0
            for s, i in enumerate(row, start=1):
                f = features[i]
                k = len(f["input_ids"])
                input_ids[r, at : at + k], labels[r, at : at + k] = self._example(f)
                token_type_ids[r, at : at + k] = f["token_type_ids"]
                attention_mask[r, at : at + k], segment_ids[r, at : at + k] = 1, s
                at += k
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
            "segment_ids": torch.from_numpy(segment_ids),
        }
        if "next_sentence_label" in features[0]:
            nsp = [int(features[i]["next_sentence_label"]) for i in order]
            batch["next_sentence_label"] = torch.tensor(nsp, dtype=torch.long)
        return batch
