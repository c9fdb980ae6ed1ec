"""A tiny prepared-data folder in the docs/architecture.md format, written by hand for train tests.

Each segment alternates two random words (``x y x y ...``); a positive pair's B continues A's
pattern, a negative's uses another pair. A masked word is predictable from its neighbours, so a
tiny model's loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from bert_mp.core.config import Config, DataConfig, HardwareConfig, ModelConfig, TrainConfig

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_WORDS = 59  # 5 specials + 59 words = 64 tokens


def wordpiece_tokenizer(
    tokens: list[str], bert_text: bool = False, pair_template: bool = False
) -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer over a fixed vocabulary (``tokens`` in id order, specials first).

    A fixed vocabulary rather than WordPiece training, whose ties are broken differently from run
    to run (huggingface/tokenizers#1794), keeps the tests deterministic. ``bert_text``: BERT's
    lowercasing normalizer and pre-tokenizer (else whitespace); ``pair_template``: the
    ``[CLS] A [SEP] B [SEP]`` post-processor.
    """
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    if bert_text:
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if pair_template:
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The 64-token vocabulary of the prepared-data fixture: specials and w0..w58."""
    return wordpiece_tokenizer(SPECIALS + [f"w{i}" for i in range(N_WORDS)])


def _rows(n: int, seed: int, max_len: int) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {"input_ids": [], "token_type_ids": [], "next_sentence_label": []}
    first = len(SPECIALS)
    for _ in range(n):
        la, lb = rng.integers(3, max_len // 2 - 2, size=2)
        pair = rng.choice(N_WORDS, size=2, replace=False) + first
        a = [int(pair[i % 2]) for i in range(la)]
        label = int(rng.random() < 0.5)
        if label == 1:
            pair = rng.choice(N_WORDS, size=2, replace=False) + first
        b = [int(pair[(la + i) % 2]) for i in range(lb)]
        ids = [2, *a, 3, *b, 3]
        cols["input_ids"].append(ids)
        cols["token_type_ids"].append([0] * (la + 2) + [1] * (lb + 1))
        cols["next_sentence_label"].append(label)
    return cols


def make_prepared(root: Path, n_train: int = 256, n_val: int = 64, max_len: int = 32) -> SimpleNamespace:
    """Write ``root/dataset``, ``root/tokenizer``, ``stats.json``, ``COMPLETE``; return a PreparedData-like object."""
    root = Path(root)
    tokenizer = make_tokenizer()
    ds = DatasetDict(
        train=Dataset.from_dict(_rows(n_train, 1, max_len)),
        validation=Dataset.from_dict(_rows(n_val, 2, max_len)),
    )
    ds.save_to_disk(str(root / "dataset"))
    tokenizer.save_pretrained(str(root / "tokenizer"))
    stats = {
        "tokenizer_size": len(tokenizer),
        "model_vocab_size": 64,
        "max_seq_length": max_len,
        "masking": "dynamic",
        "splits": {"train": n_train, "validation": n_val},
    }
    (root / "stats.json").write_text(json.dumps(stats))
    (root / "COMPLETE").write_text("")
    return SimpleNamespace(dataset=ds, tokenizer=tokenizer, stats=stats, path=root)


def tiny_config(out: Path, **train_kw) -> Config:
    """A 2-layer, width-32 model with dropout off and small batches."""
    train = dict(
        output_dir=str(out),
        max_steps=8,
        global_batch_size=8,
        micro_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=2,
        progress_bar=False,
        log_every=1,
    )
    train.update(train_kw)
    cfg = Config(
        data=DataConfig(max_seq_length=32, mlm_probability=0.15, max_predictions_per_seq=5),
        model=tiny_model_config(),
        train=TrainConfig(**train),
        # bf16/fp16 run everywhere, emulated where the CPU lacks them: at these sizes the tests check
        # the loop's numerics and bookkeeping, not speed
        hardware=HardwareConfig(allow_emulated=True),
    )
    cfg.validate()
    return cfg


def load_fixture(root: Path) -> SimpleNamespace:
    """Read a folder written by :func:`make_prepared` back (as a fresh process would)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    root = Path(root)
    return SimpleNamespace(
        dataset=load_from_disk(str(root / "dataset")),
        tokenizer=AutoTokenizer.from_pretrained(str(root / "tokenizer")),
        stats=json.loads((root / "stats.json").read_text()),
        path=root,
    )


def run_in_subprocess_main(argv: list[str]) -> None:
    """``python -c`` entry for fresh-process tests: CONFIG DATA_ROOT [STOP_AT_STEP]."""
    from bert_mp.core import callbacks
    from bert_mp.core.config import load_config
    from bert_mp.pretrain.trainer import exit_code, train

    cfg = load_config(argv[0])
    if len(argv) > 2:
        stop_at = int(argv[2])

        class StopAt(callbacks.BaseCallback):
            def on_step_end(self, state, logs):
                if state.step == stop_at:
                    state.stop_reason = f"test stop at {stop_at}"

        callbacks.REGISTRY["stop_at"] = StopAt
        cfg.train.callbacks = [*cfg.train.callbacks, "stop_at"]
    sys.exit(exit_code(train(cfg, load_fixture(Path(argv[1])))))  # the codes `bert-mp train` exits with


# --------------------------------------------------------------------------------------------------
# fault injection through the trainer's build_model seam
# --------------------------------------------------------------------------------------------------
def nan_forward_builder(bad: Callable[[int], bool]) -> Callable[..., Any]:
    """A ``build_model`` whose training forwards numbered (1-based) ``n`` with ``bad(n)`` give NaN."""
    from bert_mp.model.bert import build_model

    calls: list[int] = []

    def build(*args: Any, **kwargs: Any) -> Any:
        model = build_model(*args, **kwargs)

        def hook(module, inputs, output):
            if not module.training:
                return output
            calls.append(1)
            return output * float("nan") if bad(len(calls)) else output

        model.bert.embeddings.register_forward_hook(hook)
        return model

    return build


def inf_grad_builder(bad: Callable[[int], bool] | None, snapshots: list | None = None) -> Callable[..., Any]:
    """A ``build_model`` whose backward passes numbered ``n`` with ``bad(n)`` (None: all) give inf
    gradients in one weight; ``snapshots`` collects that weight as each backward pass saw it."""
    from bert_mp.model.bert import build_model

    seen = snapshots if snapshots is not None else []

    def build(*args: Any, **kwargs: Any) -> Any:
        model = build_model(*args, **kwargs)
        w = model.bert.encoder.layer[0].output.dense.weight

        def hook(grad):
            seen.append(w.detach().clone())
            return torch.full_like(grad, float("inf")) if bad is None or bad(len(seen)) else grad

        w.register_hook(hook)
        return model

    return build


# A small lexicon for generated corpora (prepare tests; the golden rows use its first 29 words).
LEXICON = [
    "the",
    "a",
    "module",
    "function",
    "returns",
    "value",
    "list",
    "string",
    "object",
    "file",
    "path",
    "data",
    "error",
    "type",
    "class",
    "method",
    "argument",
    "default",
    "number",
    "name",
    "time",
    "system",
    "process",
    "thread",
    "socket",
    "buffer",
    "stream",
    "parser",
    "token",
    "encode",
    "decode",
    "read",
    "write",
    "open",
    "close",
    "call",
    "raise",
    "handle",
    "check",
    "format",
    "convert",
    "create",
]


def tiny_model_config() -> ModelConfig:
    """2 layers of width 32, dropout off: the model of the fast tests."""
    return ModelConfig(
        preset="tiny",
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def run_cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m bert_mp ARGS`` in a fresh process, offline, output captured."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bert_mp", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
