"""``stats.json``: the per-split statistics summed from the blocks, the warnings a build earns, and the
human summary printed after it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from bert_mp.core.config import DataConfig
from bert_mp.core.process import console
from bert_mp.data.corpus import describe_source
from bert_mp.data.prepare.cache import SPLITS
from bert_mp.data.tokenizer import round_vocab_size


def _length_summary(column: Any, max_len: int) -> tuple[int, int, dict[str, int]]:
    """``(examples, tokens, histogram)`` of the example lengths, one Arrow chunk at a time (the
    column is memory-mapped; a whole-split length array would grow with the corpus)."""
    width = max(1, max_len // 8)
    counts = np.zeros(max_len // width + 1, dtype=np.int64)
    n = total = 0
    for chunk in column.chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
        counts += np.bincount(np.minimum(lengths, max_len) // width, minlength=counts.size)
        n += lengths.size
        total += int(lengths.sum())
    hist = {f"{i * width}-{min(max_len, (i + 1) * width - 1)}": int(c) for i, c in enumerate(counts) if c}
    return n, total, hist


def sum_block_stats(blocks: list[dict]) -> dict:
    """Block statistics (nested dicts of counts) summed key by key."""
    total: dict[str, Any] = {}

    def add(dst: dict, src: dict) -> None:
        for k, v in src.items():
            if isinstance(v, dict):
                add(dst.setdefault(k, {}), v)
            else:
                dst[k] = dst.get(k, 0) + v

    for st in blocks:
        add(total, st)
    return total


def _nsp_stats(blk: dict, examples: int, random_next: int) -> dict:
    """The NSP label balance of a split, from its summed block statistics."""
    return {
        "random_next": random_next,
        "is_next": examples - random_next,
        "random_share": (random_next / examples) if examples else None,
        "forced_random": int(blk.get("forced_random", 0)),
        "no_other_document": int(blk.get("no_other_document", 0)),
        "skipped_single_segment": int(blk.get("skipped_single_segment", 0)),
    }


def _masking_stats(m: dict) -> dict:
    """Static masking's shares: of the candidates, and the 80/10/10 split of the masked."""
    sel = max(1, m["masked"])
    return {
        "masked": m["masked"],
        "masked_share_of_candidates": m["masked"] / max(1, m["candidates"]),
        "as_mask_token": m["as_mask_token"] / sel,
        "as_random_token": (m["masked"] - m["as_mask_token"] - m["unchanged"]) / sel,
        "unchanged": m["unchanged"] / sel,
    }


def collect_stats(data, dd, tokenizer, tokenizer_from, read_stats, block_stats, timings, elapsed) -> dict:
    """``stats.json``'s content: the source and settings, then each split's figures from its blocks."""
    nsp = data.objective == "nsp"
    per_split = {}
    for s, name in enumerate(SPLITS):
        blk = sum_block_stats(block_stats[s])
        ds = dd[name]
        examples, example_tokens, histogram = _length_summary(
            ds.data.table.column("input_ids"), data.max_seq_length
        )
        entry: dict[str, Any] = {
            "examples": examples,
            "blocks": len(block_stats[s]),
            "documents": int(blk.get("documents", 0)),
            "documents_without_tokens": int(blk.get("documents_without_tokens", 0)),
        }
        if nsp:
            random_next = int(blk.get("random_next", 0))
            entry.update(
                {
                    # documents marked with [SEP] rather than a faster inline marker (tokenizer.inline_markers)
                    "sep_marked_documents": int(blk.get("sep_marked_documents", 0)),
                    "single_sentence_documents": int(blk.get("single_sentence_documents", 0)),
                    "sentences": int(blk.get("sentences", 0)),
                    "sentences_without_tokens": int(blk.get("sentences_without_tokens", 0)),
                    "sentences_cut_to_max_length": int(blk.get("sentences_cut_to_max_length", 0)),
                }
            )
        entry["tokens"] = int(blk.get("tokens", 0))
        entry["example_tokens"] = example_tokens
        # documents encoded by the faster plain-ASCII copy of the tokenizer (tokenizer.plain_ascii_encoder)
        entry["plain_ascii_documents"] = int(blk.get("plain_ascii_documents", 0))
        # special tokens' text (a [SEP] or [MASK] written in the corpus), tokenized as text
        entry["special_tokens_in_text"] = dict(sorted(blk.get("special_tokens_in_text", {}).items()))
        if nsp:
            entry["nsp"] = _nsp_stats(blk, examples, random_next)
            entry["truncated_tokens"] = int(blk.get("truncated_tokens", 0))
            # of the tokens that dupe_factor passes over the split's sentences hold
            passes = entry["tokens"] * data.dupe_factor
            entry["truncated_share"] = entry["truncated_tokens"] / passes if passes else None
        else:
            entry["nsp"] = None
            # [SEP] tokens put between consecutive documents of a block when packing
            entry["document_separators"] = int(blk.get("document_separators", 0))
        entry.update(
            {
                "length_histogram": histogram,
                "mean_length": example_tokens / examples if examples else None,
                "padding_fraction_at_max_seq_length": (
                    1.0 - example_tokens / (examples * data.max_seq_length) if examples else None
                ),
                "cpu_seconds": blk.get("seconds", {}),
            }
        )
        if "mask" in blk:
            entry["masking"] = _masking_stats(blk["mask"])
        per_split[name] = entry
    tokens = sum(v["tokens"] for v in per_split.values())
    return {
        "source": describe_source(data),
        "cache_key": data.cache_key(),
        "tokenizer": tokenizer_from,
        "tokenizer_size": len(tokenizer),
        "model_vocab_size": round_vocab_size(len(tokenizer)),
        "max_seq_length": data.max_seq_length,
        "dupe_factor": data.dupe_factor,
        "objective": data.objective,
        "documents_mode": data.documents,
        "masking": data.masking,
        "max_predictions_per_seq": data.max_predictions(),
        "documents": {**asdict(read_stats), "documents_kept": read_stats.documents_kept},
        "splits": {name: v["examples"] for name, v in per_split.items()},
        "nsp_random_share": per_split["train"]["nsp"]["random_share"] if nsp else None,
        "per_split": per_split,
        "tokens": tokens,
        "seconds": {**timings, "total": elapsed},
        "tokens_per_sec": tokens / elapsed if elapsed > 0 else None,
        "num_proc": data.num_proc,
    }


FEW_VALIDATION_DOCUMENTS = 10
"""A validation split of fewer documents is flagged: its NSP and MLM figures say little."""


def _nsp_share_off(split: dict, data: DataConfig) -> bool:
    """Whether the split's NSP random share is more than 0.05 off ``data.nsp_random_prob``."""
    share = split["nsp"]["random_share"] if split["nsp"] else None
    return share is not None and abs(share - data.nsp_random_prob) > 0.05 + 1e-9


def _nsp_share_warning(split: dict, name: str, data: DataConfig) -> str | None:
    """A warning when the split's NSP random share is off its target, with the reason and the fix."""
    if not _nsp_share_off(split, data):
        return None
    share, lo, hi = split["nsp"]["random_share"], data.nsp_random_prob - 0.05, data.nsp_random_prob + 0.05
    why = ""
    if split["nsp"]["no_other_document"] or split["nsp"]["skipped_single_segment"]:
        why = " (a block holds a single document, so a random B was impossible; add documents)"
    elif split["nsp"]["forced_random"] > 0.5 * split["examples"]:
        fix = "use longer documents"
        if data.source == "text" and data.documents == "blank_line":
            fix = "data.documents=file reads each file as one document, or use longer documents"
        why = f" (most chunks are single sentences, which force a random B; {fix})"
    return f"NSP random share {share:.3f} ({name}) is outside {max(0, lo):.2f}-{min(1, hi):.2f}{why}"


def _validation_warning(stats: dict, data: DataConfig) -> str | None:
    """A warning when a validation split was asked for but is too small to evaluate NSP or MLM."""
    val = stats["per_split"]["validation"]
    if data.validation_fraction == 0:
        return None
    problems = []
    if val["documents"] < FEW_VALIDATION_DOCUMENTS:
        problems.append(f"{val['documents']} document{'s' * (val['documents'] != 1)}")
    if val["examples"] == 0:
        problems.append("0 examples")
    if not problems:
        return _nsp_share_warning(val, "validation", data)
    if _nsp_share_off(val, data):
        problems.append(f"NSP random share {val['nsp']['random_share']:.3f}")
    return (
        f"the validation split is too small to evaluate {'NSP or ' if val['nsp'] else ''}MLM meaningfully "
        f"({', '.join(problems)}); raise data.validation_fraction (now {data.validation_fraction}, at most "
        "0.5) or add documents"
    )


def stats_warnings(stats: dict, data: DataConfig) -> list[str]:
    """The warnings ``stats.json`` records and the summary prints: NSP balance, a small validation
    split, skipped or repaired input, the masking cap."""
    out = [
        w
        for w in (
            _nsp_share_warning(stats["per_split"]["train"], "train", data),
            _validation_warning(stats, data),
        )
        if w
    ]
    d = stats["documents"]
    if d["invalid_utf8_replaced"]:
        out.append(f"{d['invalid_utf8_replaced']} invalid UTF-8 sequences were replaced with U+FFFD")
    if d["records_without_text"] or d["invalid_json_lines"]:
        out.append(
            f"skipped {d['records_without_text']} records without text and {d['invalid_json_lines']} invalid JSON "
            f"lines; first: {d['first_problem']}"
        )
    if d["binary_files"]:
        out.append(f"skipped {d['binary_files']} files that look binary; first: {d['first_binary_file']}")
    if d["duplicate_paths"]:
        out.append(
            f"{d['duplicate_paths']} files were reached twice and read once; first: {d['first_duplicate_path']}"
        )
    cap = data.masking_cap_warning()
    if cap:
        out.append(cap)
    return out


def _truncation_line(stats: dict) -> str:
    """The summary's line on the tokens NSP pairs lost to fit ``max_seq_length``, with their share."""
    splits = stats["per_split"].values()
    cut, tokens = sum(v["truncated_tokens"] for v in splits), sum(v["tokens"] for v in splits)
    dupe = stats["dupe_factor"]
    share = cut / (tokens * dupe) if tokens else 0.0
    of = f"{dupe} passes (data.dupe_factor) over " if dupe > 1 else ""
    return (
        f"  truncated: {cut} tokens cut from pairs to fit max_seq_length {stats['max_seq_length']}, "
        f"{share:.1%} of {of}the corpus's {tokens} tokens"
    )


def vocabulary_line(voc: dict) -> str:
    """The summary's line on what the vocabulary was learned from (``stats.json``'s ``vocabulary``)."""
    key = f"data.vocab_sample_chars={voc['sample_chars']}"
    if voc["whole"]:
        what = f"all {voc['documents']:,} training documents ({voc['characters']:,} characters; {key})"
    else:
        what = (
            f"a sample of {voc['documents']:,} of {voc['of_documents']:,} training documents "
            f"({voc['characters']:,} of {voc['of_characters']:,} characters; {key}, seed {voc['seed']})"
        )
    took = ", ".join(f"{k} {v:.1f} s" for k, v in voc["seconds"].items())
    return f"  vocabulary: learned from {what}; {'reused from the cache, ' if voc['reused'] else ''}{took}"


def print_summary(stats: dict, path: Path) -> None:
    """A short human summary of ``stats.json``."""
    d, train, val = stats["documents"], stats["per_split"]["train"], stats["per_split"]["validation"]
    dupes = f", {d['duplicate_documents']} duplicates removed" if d["duplicate_documents"] else ""
    sentences = f"sentences: {train['sentences'] + val['sentences']}, " if train["nsp"] is not None else ""
    lines = [
        f"prepared {stats['source']} -> {path}",
        f"  documents: {d['documents_read']} read, {d['documents_kept']} kept, {d['dropped_empty']} empty "
        f"dropped{dupes}, {train['documents']} train / {val['documents']} validation "
        f"(data.documents={stats['documents_mode']})",
        f"  {sentences}tokens: {stats['tokens']}, "
        f"tokenizer: {stats['tokenizer_size']} (model vocab {stats['model_vocab_size']})",
        *([vocabulary_line(stats["vocabulary"])] if stats.get("vocabulary") else []),
        f"  examples ({stats['objective']}): {train['examples']} train / {val['examples']} validation, "
        f"max_seq_length {stats['max_seq_length']}, mean length {train['mean_length'] or 0:.1f}, padding at "
        f"max length {(train['padding_fraction_at_max_seq_length'] or 0):.1%}",
    ]
    share = stats.get("shard") or {}
    if share.get("count", 1) > 1:
        first, end = share["documents"]
        lines.insert(
            1,
            f"  data.shard={share['index']}/{share['count']}: documents {first} to {end - 1} of the corpus's "
            f"{share['corpus_documents']} kept; read and kept below count the corpus, train / validation this share",
        )
    if train["nsp"] is not None:
        lines.append(
            f"  NSP random share (train): {train['nsp']['random_share'] or 0:.3f} "
            f"({train['nsp']['forced_random']} forced by one-segment chunks)"
        )
        lines.append(_truncation_line(stats))
    else:
        lines.append("  objective mlm: packed sequences, no NSP labels (the NSP loss is not trained)")
    written = sum_block_stats([v["special_tokens_in_text"] for v in stats["per_split"].values()])
    if written:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(written.items()))
        lines.append(f"  special tokens written in the text (tokenized as text, not as specials): {counts}")
    if "masking" in train:
        m = train["masking"]
        lines.append(
            f"  static masking: {m['masked_share_of_candidates']:.3f} of tokens, "
            f"{m['as_mask_token']:.2f}/{m['as_random_token']:.2f}/{m['unchanged']:.2f} mask/random/kept"
        )
    sec = stats["seconds"]
    lines.append(
        "  seconds: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sec.items())
        + f"; {stats['tokens_per_sec']:.0f} tokens/s"
    )
    lines += [f"  warning: {w}" for w in stats.get("warnings", [])]
    if console.is_main_process():
        print("\n".join(lines), flush=True)
