"""What the tests share: fixture data, tiny configs and tokenizers, fault injection, CLI runners.

One module for every test folder (``pythonpath = ["tests"]`` in pyproject.toml; fresh processes put
:data:`TESTS` on their path themselves). Fixtures built from these helpers are in conftest.py.

The prepared-data fixture (:func:`make_prepared`) is a tiny folder in the docs/architecture.md
format, written by hand: each segment alternates two random words (``x y x y ...``); a positive
pair's B continues A's pattern, a negative's uses another pair. A masked word is predictable from
its neighbours, so a tiny model's loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import forkserver
import numpy as np
import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertForPreTraining, BertTokenizerFast, PreTrainedTokenizerFast

from bert_mp.core.config import Config, DataConfig, HardwareConfig, ModelConfig, TrainConfig
from bert_mp.data.corpus import ReadStats, iter_documents

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository: configs/, scripts/, bert_mp/

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_WORDS = 59  # 5 specials + 59 words = 64 tokens


def cpu_mask_plus(*features: str) -> str:
    """``BERT_MP_CPU_MASK`` for a child process: the suite's own mask (``all`` in the masked rerun)
    with ``features`` added, so a test that hides one feature never unhides another."""
    own = {f.strip().lower() for f in os.environ.get("BERT_MP_CPU_MASK", "").split(",") if f.strip()}
    return "all" if "all" in own else ",".join(sorted(own | set(features)))


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


def _rows(n: int, seed: int, max_len: int, full: bool = False) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {"input_ids": [], "token_type_ids": [], "next_sentence_label": []}
    first = len(SPECIALS)
    for _ in range(n):
        la, lb = rng.integers(3, max_len // 2 - 2, size=2)
        if full:  # the longest pair: every padded batch has one length
            la = lb = max_len // 2 - 3
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


def make_prepared(
    root: Path, n_train: int = 256, n_val: int = 64, max_len: int = 32, full: bool = False
) -> SimpleNamespace:
    """Write ``root/dataset``, ``root/tokenizer``, ``stats.json``, ``PREPARED``; return a PreparedData-like
    object. ``full``: every pair of one length (``max_len - 3``), so a compiled padded run sees one shape."""
    root = Path(root)
    tokenizer = make_tokenizer()
    ds = DatasetDict(
        train=Dataset.from_dict(_rows(n_train, 1, max_len, full)),
        validation=Dataset.from_dict(_rows(n_val, 2, max_len, full)),
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
    (root / "PREPARED").write_text("")
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


def tiny_gpu_config(out: Path, **train_kw) -> Config:
    """:func:`tiny_config` with tensor-core friendly widths (64 wide, 2 heads of 32)."""
    cfg = tiny_config(out, **train_kw)
    cfg.model.hidden_size, cfg.model.intermediate_size = 64, 128
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
    stop_at = int(argv[2]) if len(argv) > 2 else None
    sys.exit(run_config(Path(argv[0]), Path(argv[1]), stop_at))  # the codes `bert-mp train` exits with


def run_config(config_path: Path, data_root: Path, stop_at: int | None = None) -> int:
    """Train the config saved at ``config_path`` on the fixture at ``data_root`` in *this* process,
    stopping (and saving) after step ``stop_at`` if given; the exit code `bert-mp train` would give.

    What a fresh process runs (:func:`run_in_subprocess_main`); a fresh-process test also calls it
    directly for the runs it compares against, so that only the run it is about pays a process start.
    """
    from bert_mp.core.config import load_config
    from bert_mp.core.loop import callbacks
    from bert_mp.pretrain import monitors
    from bert_mp.pretrain.trainer import exit_code, train

    cfg = load_config(str(config_path))
    registered = monitors.REGISTRY.get("stop_at")
    if stop_at is not None:

        class StopAt(callbacks.BaseCallback):
            def on_step_end(self, state, facts, logs):
                if state.step == stop_at:
                    state.stop_reason = f"test stop at {stop_at}"

        monitors.REGISTRY["stop_at"] = StopAt
        cfg.train.callbacks = [*cfg.train.callbacks, "stop_at"]
    reset_accelerate()  # a run before this one in the same process leaves Accelerate's singletons set
    try:
        return exit_code(train(cfg, load_fixture(data_root)))
    finally:
        if registered is None:
            monitors.REGISTRY.pop("stop_at", None)
        else:
            monitors.REGISTRY["stop_at"] = registered


def free_port() -> int:
    """A TCP port no process listens on now (the OS picks it), for a launch's rendezvous: tests that
    run side by side (pytest-xdist workers) never share one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fresh_process_main(setup: str = "") -> str:
    """Python source that runs :func:`run_in_subprocess_main` on its arguments: ``python -c`` code, or
    a script's text. ``setup`` (statements ending in ``; ``) runs first."""
    return (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); {setup}"
        "import support; support.run_in_subprocess_main(sys.argv[1:])"
    )


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


# The fixed tokenizer's words and the golden corpora's (tests/unit/data/test_prepare_golden.py's
# digests were recorded with them).
FIXED_WORDS = LEXICON[:29]
PUNCT = list(".,;:!?()'\"-|")


def fixed_tokenizer(folder: Path) -> Path:
    """A WordPiece tokenizer with a hand-written vocabulary (training is not reproducible), saved
    to ``folder``: specials, :data:`FIXED_WORDS`, punctuation and single letters."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = [*SPECIALS, *FIXED_WORDS, *PUNCT, *letters, *("##" + c for c in letters)]
    tk = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    BertTokenizerFast(tokenizer_object=tk).save_pretrained(str(folder))
    return folder


def write_corpus(path: Path, n_docs: int = 150, seed: int = 0, max_sents: int = 10) -> Path:
    """Text file of documents (blank-line separated) of random sentences from :data:`LEXICON`."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.randint(1, max_sents)):
            words = [rng.choice(LEXICON) for _ in range(rng.randint(3, 18))]
            sents.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
        docs.append(" ".join(sents))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def read_documents(**kw) -> tuple[list[str], ReadStats]:
    """The documents a ``DataConfig(**kw)`` reads, and the reader's counts."""
    stats = ReadStats()
    return list(iter_documents(DataConfig(**kw), stats)), stats


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


def tiny_unpadded_model(max_len: int) -> Any:
    """A seeded 2-layer, 32-wide BertForPreTraining without dropout, wrapped for the unpadded path."""
    from bert_mp.model.bert import PretrainingModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return PretrainingModel(BertForPreTraining(cfg), unpad=True)


def assert_same_step(model: Any, reference: Any, batch: dict, reference_batch: dict) -> None:
    """One micro-batch through both ``PretrainingModel``s from zeroed gradients: the same loss sums and
    counts (1e-5) and the same gradients (1e-4 relative), in fp32 - another layout of the same examples."""
    model.zero_grad(), reference.zero_grad()
    got, want = model(**batch), reference(**reference_batch)
    (got["mlm_loss_sum"] + got["nsp_loss_sum"]).backward()
    (want["mlm_loss_sum"] + want["nsp_loss_sum"]).backward()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def run_unpadded_batch(model: Any, batch: dict) -> tuple[Any, Any, Any]:
    """``model.unpad.run_unpadded`` on a collated batch: (token states, pooled [CLS] states, labels)."""
    from bert_mp.model.unpad import run_unpadded

    return run_unpadded(
        model,
        batch["input_ids"],
        batch["token_type_ids"],
        batch["labels"],
        batch["attention_mask"],
        batch.get("segment_ids"),
    )


def run_cli(
    *args: str, cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m bert_mp ARGS`` in a process of its own (forked from a server that imported the
    libraries already: tests/forkserver.py), offline, output captured (``env``: instead of this
    process's environment, offline)."""
    if env is None:
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
    return forkserver.run(
        [sys.executable, "-m", "bert_mp", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """``python -m bert_mp ARGS`` (tests/forkserver.py) started in its own session (:func:`own_session`: its process group is
    killed when the test ends, however it ends), stdout and stderr piped."""
    return own_session(
        forkserver.popen(
            [sys.executable, "-m", "bert_mp", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    )


def reset_accelerate() -> None:
    """Reset Accelerate's process-wide singletons, as between two runs in one process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def load_script(name: str) -> ModuleType:
    """``scripts/<room>/<name>.py`` (``name`` as ``"drills/fault"``) as a module of its room's package,
    as the scripts import each other (``scripts/`` on the path), loaded once."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name.replace("/", "."))


# --------------------------------------------------------------------------------------------------
# fine-tuning: a tiny checkpoint and a task it learns in a few steps
# --------------------------------------------------------------------------------------------------
FINETUNE_WORDS = ["apple", "stone", "river", "cloud", "paper", "green", "seven", "window", "quiet", "metal"]


def finetune_tokenizer(texts: list[str], vocab_size: int = 120) -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer over the words of ``texts`` (plus digits), padded with filler
    tokens to ``vocab_size``."""
    words = sorted({w for text in texts for w in text.lower().split() if not w.isdigit()})
    digits = [str(d) for d in range(10)] + [f"##{d}" for d in range(10)]
    vocab = SPECIALS + words + digits
    vocab += [f"filler{i}" for i in range(vocab_size - len(vocab))]
    return wordpiece_tokenizer(vocab, bert_text=True, pair_template=True)


def make_checkpoint(folder, tokenizer, vocab_size=None, max_pos=64, seed=1234) -> Path:
    """A tiny BertForPreTraining export like bert_mp's final/: save_pretrained + tokenizer."""
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=vocab_size or -(-len(tokenizer) // 64) * 64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_pos,
    )
    BertForPreTraining(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def sentence(i: int, label_word: str) -> str:
    """Filler words plus a word that decides the label: a task a tiny model learns in a few steps."""
    words = FINETUNE_WORDS
    filler = [
        words[(i * 7 + j * 3) % len(words)]
        for j in range(6)
        if words[(i * 7 + j * 3) % len(words)] not in ("apple", "stone")
    ]
    return " ".join(filler[:3] + [label_word] + filler[3:])


def write_csv(path: Path, n: int, offset: int = 0, labels=("apple", "stone")) -> str:
    """A text,label CSV of ``n`` :func:`sentence` rows (numbered from ``offset``)."""
    lines = ["text,label"]
    for i in range(offset, offset + n):
        word = labels[i % len(labels)]
        lines.append(f"{sentence(i, word)},{word}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def finetune_overrides(ckpt, tmp_path: Path, **extra) -> list[str]:
    """``finetune.*`` overrides for a 4-epoch run from ``ckpt`` on CSVs written under ``tmp_path``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = {
        "checkpoint": ckpt,
        "task": "local",
        "train_file": write_csv(tmp_path / "train.csv", 96),
        "validation_file": write_csv(tmp_path / "val.csv", 24, offset=500),
        "test_file": write_csv(tmp_path / "test.csv", 24, offset=900),
        "output_dir": tmp_path / "out",
        "batch_size": 16,
        "learning_rate": 3e-3,
        "warmup_ratio": 0.0,
        "epochs": 4,
        "max_seq_length": 32,
        "progress_bar": False,
    }
    base.update(extra)
    return [f"finetune.{k}={v}" for k, v in base.items()]


# --------------------------------------------------------------------------------------------------
# golden numbers: tests/unit/pretrain/test_golden_train.py, tests/integration/test_golden_sweep.py
#
# CPUs differ in the last bits: oneDNN / ATen pick other kernels on AMX, AVX512-BF16 or AVX2-only
# machines. A recording stores a fingerprint of what selects those kernels (torch version, ATen's
# CPU capability, oneDNN bf16/fp16 support). Where the fingerprint matches, every value and the
# weight hash must be equal to the last bit; elsewhere values are compared with a tolerance (fp32:
# rtol 1e-4, a few hundred ulps of drift over a dozen steps; bf16: rtol 3e-2, its 8-bit mantissa) and
# the hash check is skipped with a message.
# --------------------------------------------------------------------------------------------------
GOLDEN = TESTS / "golden"
GOLDEN_RTOL = {"fp32": 1e-4, "bf16": 3e-2}
GOLDEN_EVAL_KEYS = ("eval/loss_mlm", "eval/loss_nsp", "eval/accuracy_mlm", "eval/accuracy_nsp")
# Re-record (only when a change is *meant* to alter the numbers): the golden tests with this set.
GOLDEN_RECORD = os.environ.get("BERT_MP_GOLDEN_RECORD") == "1"
GOLDEN_RECORD_COMMAND = (
    "BERT_MP_GOLDEN_RECORD=1 bash scripts/test.sh "
    "tests/unit/pretrain/test_golden_train.py tests/integration/test_golden_sweep.py"
)


def golden_fingerprint() -> dict[str, Any]:
    """What decides which CPU kernels run: read from torch itself, never from bert_mp (tests patch it)."""
    import platform

    import transformers

    def probe(op: str) -> bool | None:
        try:
            return bool(getattr(torch.ops.mkldnn, op)())
        except (AttributeError, RuntimeError):
            return None

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": probe("_is_mkldnn_bf16_supported"),
        "mkldnn_fp16": probe("_is_mkldnn_fp16_supported"),
    }


def golden_compare(got: Any, want: Any, rtol: float | None, where: str, problems: list[str]) -> None:
    """Exact when ``rtol`` is None; numbers within ``rtol`` otherwise. Strings always exact."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            problems.append(f"{where}: keys {sorted(got)} != {sorted(want)}")
            return
        for k in want:
            if k != "weights_sha256":
                golden_compare(got[k], want[k], rtol, f"{where}.{k}", problems)
    elif isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            problems.append(f"{where}: {len(got)} items, expected {len(want)}")
            return
        for i, (g, w) in enumerate(zip(got, want)):
            golden_compare(g, w, rtol, f"{where}[{i}]", problems)
    elif isinstance(want, float) and isinstance(got, (int, float)):
        if rtol is None:
            if not (got == want or (math.isnan(got) and math.isnan(want))):
                problems.append(f"{where}: {got!r} != {want!r}")
        elif not math.isclose(got, want, rel_tol=rtol, abs_tol=rtol * 1e-3):
            problems.append(f"{where}: {got!r} differs from {want!r} by more than rtol {rtol}")
    elif got != want:
        problems.append(f"{where}: {got!r} != {want!r}")


def golden_load(name: str) -> dict[str, Any]:
    """golden/<name>.json; a missing file fails the test with the command that records it."""
    import pytest

    path = GOLDEN / f"{name}.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing; record it with `{GOLDEN_RECORD_COMMAND}`")
    return json.loads(path.read_text())


def golden_record(name: str, key: str | None, value: dict[str, Any]) -> None:
    """Store ``value`` (under ``key``) in golden/<name>.json with this machine's fingerprint."""
    path = GOLDEN / f"{name}.json"
    old = json.loads(path.read_text()) if path.is_file() and key else {}
    if old.get("fingerprint") != golden_fingerprint():
        old = {}
    new = {**old, "fingerprint": golden_fingerprint()}
    if key:
        new.setdefault("runs", {})[key] = value
    else:
        new.update(value)
    GOLDEN.mkdir(exist_ok=True)
    path.write_text(json.dumps(new, indent=1) + "\n")


# --------------------------------------------------------------------------------------------------
# acting on a running process: hold it at a named point first (bert_mp.core.process.hold), never race it
# --------------------------------------------------------------------------------------------------
def hold_env(point: str, ready: Path) -> dict[str, str]:
    """Environment that stops a command at ``point`` (``step:2``, ``prepare:paired``, ...) until a
    signal reaches it; ``ready`` appears once it is there."""
    from bert_mp.core.process.hold import HOLD_ENV, READY_ENV

    Path(ready).unlink(missing_ok=True)
    return {HOLD_ENV: point, READY_ENV: str(ready)}


_OWN_SESSIONS: list[subprocess.Popen] = []


def own_session(proc: subprocess.Popen) -> subprocess.Popen:
    """``proc``, started with ``start_new_session=True``: its process group is killed when the test
    ends (:func:`end_own_sessions`, an autouse fixture's teardown), however the test ends. A failed,
    timed-out or interrupted test then leaves no command waiting at its hold point, nor the workers
    it forked: a Ctrl-C to pytest never reaches another session."""
    _OWN_SESSIONS.append(proc)
    return proc


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            fields = text[text.rindex(")") + 2 :].split()  # after comm: state ppid pgrp ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def end_own_sessions() -> None:
    """SIGKILL what is left of each registered process group, and reap its leader. A group that
    ended already is left alone (its id is only killed while a process still holds it)."""
    while _OWN_SESSIONS:
        proc = _OWN_SESSIONS.pop()
        running = proc.poll() is None
        if running or _group_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=60)


def wait_held(proc: subprocess.Popen, ready: Path, timeout: float = 300.0) -> None:
    """Block until ``proc`` holds at its point (``ready`` exists); fail if it exits first. Waiting on
    the process is the poll interval (no sleep): its exit is noticed at once."""
    import time

    deadline = time.monotonic() + timeout
    while not Path(ready).exists():
        try:
            proc.wait(timeout=0.02)
        except subprocess.TimeoutExpired:
            assert time.monotonic() < deadline, f"the process did not reach its hold point in {timeout} s"
            continue
        out, err = proc.communicate()
        raise AssertionError(f"exited {proc.returncode} before its hold point:\n{out!s:.3000}\n{err!s:.3000}")


def launch_config(
    cfg: Config,
    data_root: Path,
    processes: int,
    *,
    options: tuple[str, ...] = (),
    stop_at: int | None = None,
    codes: tuple[int, ...] = (0,),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Train ``cfg`` on the fixture at ``data_root`` under ``accelerate launch`` with ``processes``
    processes (gloo; ``options``: further launch options, e.g. ``--config_file``), in a fresh launcher
    with its own rendezvous port; ``stop_at``: stop (and save) after that step. Asserts that the
    launcher exits with one of ``codes``."""
    from bert_mp.core.config import save_config
    from bert_mp.core.process.spawn import accelerate_launch

    cfg_path = Path(cfg.train.output_dir).with_suffix(".yaml")
    save_config(cfg, cfg_path)
    script = cfg_path.with_suffix(".py")
    script.write_text(fresh_process_main() + "\n")
    cmd = [
        *accelerate_launch(processes, cuda=False, extra=list(options), port=free_port()),
        str(script),
        str(cfg_path),
        str(data_root),
        *([str(stop_at)] if stop_at is not None else []),
    ]
    full_env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in codes, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# --------------------------------------------------------------------------------------------------
# launched runs: a small text corpus prepared once, and the environment of a launched process
# --------------------------------------------------------------------------------------------------
LAUNCH_DATA = [
    "data.source=text",
    "data.paths=[corpus/a.txt]",
    "data.tokenizer=tok",
    "data.max_seq_length=32",
    "data.validation_fraction=0.1",
    "data.cache_dir=data",
]
"""The data overrides of a launched run's project folder (paths relative to it)."""
LAUNCH_MODEL = [
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
]
"""The tiny model of a launched run (2 layers of width 32)."""


TINY_SWEEP_MODEL = [
    "data.vocab_size=512",
    "data.max_seq_length=32",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "model.max_position_embeddings=64",
]
"""The vocabulary, sequence length and model of the CLI's tiny sweeps (width 32, the preset's layers)."""


def launch_project(root: Path) -> Path:
    """``root/corpus/a.txt``, ``root/tok`` and the prepared ``root/data/<key>/`` that every launched run
    of a test module reuses (the runs start in ``root``)."""
    from bert_mp.core.config import load_config
    from bert_mp.data.prepare import prepare

    rng = random.Random(0)
    docs = [
        " ".join(" ".join(f"w{rng.randrange(59)}" for _ in range(rng.randint(4, 12))) + "." for _ in range(4))
        for _ in range(120)
    ]
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    make_tokenizer().save_pretrained(str(root / "tok"))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        prepare(load_config(None, LAUNCH_DATA))
    finally:
        os.chdir(cwd)
    return root


def launch_env(**extra: str) -> dict[str, str]:
    """A launched run's environment: offline, one thread per process, quiet tokenizers."""
    return {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        **extra,
    }


# --------------------------------------------------------------------------------------------------
# GLUE: a tiny local copy in the Hub's own layout (nyu-mll/glue's parquet files)
# --------------------------------------------------------------------------------------------------
GLUE_CLASSES = {
    "cola": ("sentence", None, ["unacceptable", "acceptable"]),
    "sst2": ("sentence", None, ["negative", "positive"]),
    "mrpc": ("sentence1", "sentence2", ["not_equivalent", "equivalent"]),
    "qqp": ("question1", "question2", ["not_duplicate", "duplicate"]),
    "stsb": ("sentence1", "sentence2", None),  # a float score, 0-5
    "mnli": ("premise", "hypothesis", ["entailment", "neutral", "contradiction"]),
    "qnli": ("question", "sentence", ["entailment", "not_entailment"]),
    "rte": ("sentence1", "sentence2", ["entailment", "not_entailment"]),
    "wnli": ("sentence1", "sentence2", ["not_entailment", "entailment"]),
}
GLUE_WORDS = ["apple", "stone", "river"]
"""The word in each row that decides its label (class i: GLUE_WORDS[i]; STS-B: its score)."""


def _glue_split(task: str, n: int, offset: int, hidden: bool) -> Dataset:
    import datasets

    text, pair, names = GLUE_CLASSES[task]
    classes = len(names) if names else 2
    cols: dict[str, list] = {text: [], **({pair: []} if pair else {}), "label": [], "idx": []}
    for i in range(offset, offset + n):
        k = i % classes
        cols[text].append(sentence(i, GLUE_WORDS[k]))
        if pair:
            cols[pair].append(sentence(i + 1, GLUE_WORDS[k]))
        score = 4.5 - 3.5 * k + 0.1 * (i % 5)  # STS-B: the word decides the score, a little noise on top
        cols["label"].append(-1 if hidden else (float(score) if names is None else k))
        cols["idx"].append(i)
    label = datasets.Value("float32") if names is None else datasets.ClassLabel(names=names)
    features = datasets.Features(
        {
            c: datasets.Value("int32")
            if c == "idx"
            else (label if c == "label" else datasets.Value("string"))
            for c in cols
        }
    )
    return Dataset.from_dict(cols, features=features)


def write_glue_folder(
    root: Path, tasks: tuple[str, ...] = tuple(GLUE_CLASSES), n_train: int = 48, n_eval: int = 16
) -> Path:
    """``root/<task>/<split>-00000-of-00001.parquet`` for ``tasks``, written as the Hub's files are (the
    ``datasets`` features in the parquet metadata, -1 for the hidden test labels): train, the labelled
    evaluation splits (MNLI: matched and mismatched) and the test splits."""
    for task in tasks:
        folder = Path(root) / task
        folder.mkdir(parents=True, exist_ok=True)
        evals = ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        tests = ["test_matched", "test_mismatched"] if task == "mnli" else ["test"]
        splits = {"train": (n_train, 0, False)}
        splits.update({s: (n_eval, 500 + 100 * j, False) for j, s in enumerate(evals)})
        splits.update({s: (n_eval, 900 + 100 * j, True) for j, s in enumerate(tests)})
        for split, (n, offset, hidden) in splits.items():
            _glue_split(task, n, offset, hidden).to_parquet(folder / f"{split}-00000-of-00001.parquet")
    return Path(root)


def glue_checkpoint(folder: Path) -> Path:
    """A tiny BertForPreTraining export whose tokenizer knows the GLUE folder's words."""
    texts = [sentence(i, w) for i in range(20) for w in GLUE_WORDS]
    return make_checkpoint(folder, finetune_tokenizer(texts))


def launch_ranks(launch: subprocess.Popen, started: list) -> dict[int, Any]:
    """The two ranks (``RANK`` 0 and 1) under a held ``bert-mp launch``, as ``psutil.Process`` by RANK.
    torch elastic starts each in its own session: every process found is appended to ``started``, for
    the test to kill when it ends, however it ends."""
    import psutil

    found = {}
    for p in psutil.Process(launch.pid).children(recursive=True):
        started.append(p)
        rank = p.environ().get("RANK")
        if rank is not None and "bert_mp" in " ".join(p.cmdline()):
            found[int(rank)] = p
    assert sorted(found) == [0, 1], found
    return found


def all_ended(procs: list, timeout: float) -> bool:
    """Whether every process in ``procs`` (anything with a ``pid``) ends within ``timeout`` seconds (a
    pidfd each: readable once the process has exited, zombie or reaped; no polling)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            fd = os.pidfd_open(p.pid)
        except ProcessLookupError:
            continue
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return False
        finally:
            os.close(fd)
    return True


def ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (its ``SigIgn`` mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    bits = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return {n for n in signal.valid_signals() if bits >> (n - 1) & 1}


PARITY_STEPS = 200


def _base(step: int) -> tuple[float, float]:
    return 2.0 + 6.0 * math.exp(-step / 60), 0.45 + 0.25 * math.exp(-step / 80)


def synthetic_rows(scale=1.0, noise=0.0, seed=0, nan_at=None, blowup_from=None, evals=(100, 200)):
    """metrics.jsonl rows following the run-folder contract, with controlled deviations."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, PARITY_STEPS + 1):
        mlm, nsp = _base(step)
        mlm = mlm * scale * (1 + rng.gauss(0, noise))
        nsp = nsp * scale * (1 + rng.gauss(0, noise))
        if blowup_from is not None and step >= blowup_from:
            mlm *= 1 + 0.05 * (step - blowup_from)
        if nan_at is not None and step == nan_at:
            mlm = float("nan")
        rows.append(
            {"step": step, "kind": "train", "loss/mlm": mlm, "loss/nsp": nsp, "loss/total": mlm + nsp}
        )
    for step in evals:
        mlm, nsp = _base(step)
        rows.append(
            {
                "step": step,
                "kind": "eval",
                "eval/loss_mlm": mlm * scale * (1 + rng.gauss(0, noise)),
                "eval/loss_nsp": nsp * scale * (1 + rng.gauss(0, noise)),
                "eval/accuracy_mlm": 0.3,
                "eval/accuracy_nsp": 0.6,
            }
        )
    return rows
