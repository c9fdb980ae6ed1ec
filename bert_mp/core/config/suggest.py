"""An unknown key named with the keys it may have meant: ``data.files: unknown key; did you mean
data.paths?``, for every section alike (and for a misspelt section)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

ALIASES: dict[str, tuple[str, ...]] = {
    "file": ("paths", "train_file"),
    "files": ("paths",),
    "path": ("paths",),
    "glob": ("paths",),
    "corpus": ("paths", "source"),
    "dataset": ("hub_name",),
    "lr": ("learning_rate",),
    "batch": ("global_batch_size", "micro_batch_size", "batch_size"),
    "batch_size": ("global_batch_size", "micro_batch_size"),
    "steps": ("max_steps",),
    "num_steps": ("max_steps",),
    "epochs": ("max_steps",),
    "seq_len": ("max_seq_length",),
    "seq_length": ("max_seq_length",),
    "max_len": ("max_seq_length",),
    "max_length": ("max_seq_length",),
    "dtype": ("precision",),
    "mixed_precision": ("precision",),
    "amp": ("precision",),
    "emulate": ("allow_emulated",),
    "out_dir": ("output_dir",),
    "output": ("output_dir",),
    "workers": ("num_workers", "num_proc"),
    "vocab": ("vocab_size",),
    "layers": ("num_hidden_layers",),
    "heads": ("num_attention_heads",),
}
"""Words people write for a key (other tools' names): the keys of a section they may mean."""
GENERIC_WORDS = frozenset({"max", "min", "num", "size", "use", "is", "of", "the", "per"})
"""Parts of a key too common to point at one key."""
MAX_SUGGESTIONS = 3


def suggestions(name: str, keys: Sequence[str]) -> list[str]:
    """Keys of ``keys`` that ``name`` may have meant, best first: a known synonym, a close spelling,
    then keys that share a word with it (``batch`` -> ``global_batch_size``)."""
    low = name.lower()
    found = [k for k in ALIASES.get(low, ()) if k in keys]
    found += difflib.get_close_matches(low, list(keys), n=MAX_SUGGESTIONS, cutoff=0.6)
    words = {w for w in low.split("_") if len(w) > 2 and w not in GENERIC_WORDS}
    found += [k for k in keys if words & set(k.split("_"))]
    return list(dict.fromkeys(found))[:MAX_SUGGESTIONS]


def unknown_key_message(section: str, name: str, tree: Mapping[str, Sequence[str]]) -> str:
    """The one line for ``section.name`` that the section lacks; ``tree``: every section's keys."""
    keys = tree[section]
    near = [f"{section}.{k}" for k in suggestions(name, keys)]
    # the same key in another section (model.max_seq_length for data.max_seq_length)
    near += [f"{other}.{name}" for other, ks in tree.items() if other != section and name in ks]
    near = list(dict.fromkeys(near))[:MAX_SUGGESTIONS]
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return f"{section}.{name}: unknown key{hint} (every key of {section}: bert-mp config {section})"


def unknown_section_message(name: str, sections: Sequence[str]) -> str:
    """The one line for a top-level key that is no section."""
    near = suggestions(name, sections)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return f"{name}: unknown section{hint} (the sections: {', '.join(sections)})"
