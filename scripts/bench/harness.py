"""The measuring harness the training benchmarks share: the prepared examples (synthetic rows or a real
corpus prepared by ``bert-mp prepare``), the plain Hugging Face baseline loop, one ``bert-mp train`` run
measured from its own metrics, and the machine's description.

Rules every benchmark keeps (docs/benchmarks.md): warm up before timing; synchronise the device only
at measurement points; count real (non-padding) tokens; compare against a baseline measured in the
same run on the same machine, and write each result the moment it is measured.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def synthetic_prepared(n: int, seq: int, vocab_size: int, model_vocab: int, seed: int = 0) -> SimpleNamespace:
    """Prepared-data contract in memory: NSP pairs of random tokens, 10% shorter (BERT's short_seq_prob)."""
    import numpy as np
    from datasets import Dataset, DatasetDict

    rng = np.random.default_rng(seed)
    cols: dict = {"input_ids": [], "token_type_ids": [], "next_sentence_label": []}
    for _ in range(n):
        total = seq if rng.random() >= 0.1 else int(rng.integers(16, seq))
        la = int(rng.integers(1, total - 4))
        lb = total - 3 - la
        ids = [2, *rng.integers(5, vocab_size, la).tolist(), 3, *rng.integers(5, vocab_size, lb).tolist(), 3]
        cols["input_ids"].append(ids)
        cols["token_type_ids"].append([0] * (la + 2) + [1] * (lb + 1))
        cols["next_sentence_label"].append(int(rng.integers(0, 2)))
    ds = Dataset.from_dict(cols)
    stats = {"tokenizer_size": vocab_size, "model_vocab_size": model_vocab, "max_seq_length": seq}
    return SimpleNamespace(
        dataset=DatasetDict(train=ds, validation=ds.select(range(min(64, n)))),
        tokenizer=_tokenizer(vocab_size),
        stats=stats,
        path="",
    )


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def dropout_kw(args) -> dict:
    """``--attention-dropout``, when given, for every model of the run (HF baseline included)."""
    p = getattr(args, "attention_dropout", None)
    return {} if p is None else {"attention_probs_dropout_prob": p}


def baseline_setup(data, args, order: np.ndarray, device: torch.device):
    """The plain HF model (seeded) and its pre-collated batches, all on ``device``."""
    import torch
    from transformers import BertForPreTraining

    from bert_mp.core.config import DataConfig, ModelConfig
    from bert_mp.data.masking import PretrainingCollator
    from bert_mp.model.bert import bert_config

    collator = PretrainingCollator(
        data.tokenizer, getattr(args, "data_cfg", None) or DataConfig(max_seq_length=args.seq), seed=42
    )
    ds, mb = data.dataset["train"], args.micro_batch
    batches = []
    for s in range(args.warmup + args.steps):
        idx = order[s * mb : (s + 1) * mb]
        batch = collator([{**ds[int(i)], "index": int(i), "epoch": 0} for i in idx])
        batches.append({k: v.to(device) for k, v in batch.items()})
    torch.manual_seed(0)
    model = BertForPreTraining(
        bert_config(ModelConfig(preset=args.preset, **dropout_kw(args)), vocab_size=args.vocab)
    )
    return model.to(device).train(), batches


def bench_baseline(data, args, order: np.ndarray, device: torch.device, precision: str = "fp32") -> dict:
    """The plain HF loop on pre-collated batches on ``device``: strict fp32, or bf16 autocast."""
    import torch

    from bert_mp.core.numerics.precision import resolve_precision

    plan = resolve_precision(precision, device)
    plan.apply_backend_flags()
    model, batches = baseline_setup(data, args, order, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = [int(b["attention_mask"].sum()) for b in batches[args.warmup :]]  # before timing: no sync inside

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i, batch in enumerate(batches):
        if i == args.warmup:
            sync()  # measurement point: the warm-up steps have finished
            t0 = time.perf_counter()
        with plan.autocast():
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    sync()  # measurement point: every timed step has finished
    secs = time.perf_counter() - t0
    return {
        "tokens_per_sec": sum(tokens) / secs,
        "step_ms": 1000 * secs / args.steps,
        "steps": args.steps,
        "device": str(device),
        "precision": precision,
    }


def bench_bert_mp(
    data,
    args,
    precision: str,
    out: Path,
    data_cfg=None,
    unpad: bool = False,
    compile_mode: str | None = None,
    extra: dict | None = None,
) -> dict:
    """``bert_mp.pretrain.trainer.train`` with the same model and batch; throughput from its own metrics.jsonl.

    ``data_cfg``: the prepared data's own section (default: synthetic rows of ``--seq``); ``unpad``:
    ``model.unpad``; ``compile_mode``: ``train.compile`` (default ``--compile``); ``extra``: dotted
    config keys set last (``{"train.compile_mode": "reduce-overhead"}``), as on the command line.
    """
    import numpy as np
    import torch

    from bert_mp.core.config import Config, DataConfig, HardwareConfig, ModelConfig, TrainConfig
    from bert_mp.core.storage.files import read_jsonl
    from bert_mp.pretrain.trainer import train

    reset_accelerate()
    cfg = Config(
        # a copy: ``extra``'s data.* keys set one row's data section, never the rows after it
        data=copy.deepcopy(data_cfg) if data_cfg is not None else DataConfig(max_seq_length=args.seq),
        model=ModelConfig(
            preset=args.preset,
            dropout_impl=args.dropout_impl,
            attn_implementation=args.attn_implementation,
            unpad=unpad,
            **dropout_kw(args),
        ),
        train=TrainConfig(
            output_dir=str(out),
            precision=precision,
            max_steps=args.warmup + args.steps,
            global_batch_size=args.micro_batch,
            micro_batch_size=args.micro_batch,
            learning_rate=1e-4,
            eval_max_batches=1,
            progress_bar=False,
            export=False,
            compile=compile_mode or args.compile,
            # on CUDA the host reads the step metrics every log_every steps and each step of a window
            # gets the window's mean time: one window for the warm-up steps, the rest after it
            # (on a CPU reading them costs nothing: every step is its own row)
            log_every=1 if not torch.cuda.is_available() or args.device == "cpu" else max(1, args.warmup),
        ),
        hardware=HardwareConfig(allow_emulated=args.allow_emulated),
    )
    for key, value in (extra or {}).items():
        section, _, name = key.partition(".")
        if not hasattr(getattr(cfg, section), name):
            raise SystemExit(f"unknown config key {key}")
        setattr(getattr(cfg, section), name, value)
    cfg.validate()
    summary = train(cfg, data)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"][args.warmup :]
    secs = sum(r["time/step_ms"] for r in rows) / 1000

    def total(key: str) -> float:  # a per-second figure of every timed step, summed over the window
        return sum(r[key] * r["time/step_ms"] / 1000 for r in rows)

    mfus = [r.get("throughput/mfu") for r in rows]
    flops = total("throughput/flops_per_sec") / secs
    gemm = getattr(args, "gemm_flops", None)
    return {
        "tokens_per_sec": total("throughput/tokens_per_sec") / secs,
        "positions_per_sec": total("throughput/positions_per_sec") / secs,
        "flops_per_sec": flops,
        # the second ceiling: this machine's own bf16 GEMM rate, measured in the same process
        "gemm_share": flops / gemm if gemm else None,
        "step_ms": 1000 * secs / len(rows),
        # per logged row (one step on a CPU, a window's mean on CUDA): a late recompile shows here
        "step_ms_each": [round(r["time/step_ms"], 2) for r in rows],
        "steps": len(rows),
        "mfu": float(np.median(mfus)) if all(m is not None for m in mfus) and mfus else None,
        "data_wait_fraction": float(np.mean([r["data/wait_fraction"] for r in rows])),
        "peak_memory_bytes": summary.get("memory", {}).get("peak_bytes"),
        "peak_reserved_bytes": summary.get("memory", {}).get("peak_reserved_bytes"),
        "compile": compile_mode or args.compile,
        # data.token_budget: the fixed shape and the attention route its steps took (varlen or the mask)
        "token_budget": (summary.get("data") or {}).get("token_budget"),
        "compiled_graphs": (summary.get("compile") or {}).get("graphs"),
        "graph_breaks": (summary.get("compile") or {}).get("graph_breaks"),
        "cudagraph_skips": (summary.get("compile") or {}).get("cudagraph_skips"),
        "precision_in_effect": summary["precision"],
    }


def time_ms(fn: Any, reps: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events around each call on a GPU, synchronised only at each
    call's end event; the host clock around a CPU call)."""
    import torch

    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # measurement point
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
    times.sort()
    return times[len(times) // 2]


def gemm_rate(device: Any = None, n: int | None = None, reps: int = 10) -> dict[str, Any]:
    """This machine's own dense bf16 matmul rate: an ``n x n`` by ``n x n`` product of random data (8192 on
    a GPU, 512 on a CPU), the median of ``reps`` after three warm-up products. The ceiling beside the
    datasheet peak: a row's FLOP/s over it is the share of what this machine's GEMMs reach at all."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = n or (8192 if device.type == "cuda" else 512)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    ms = time_ms(lambda: a @ b, reps)
    return {"dtype": "bf16", "n": n, "reps": reps, "ms": ms, "flops_per_sec": 2 * n**3 / (ms / 1000)}


def inductor_probe() -> dict[str, Any]:
    """A tiny function compiled by inductor (compile left on even under ``TORCH_COMPILE_DISABLE``): whether
    its compiled graph came from inductor's FX-graph cache, where that cache is, and the compile's
    seconds (``levers.py --cache-probe``: whether a cache made by an earlier command is found)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    before = dict(counters["inductor"])
    with torch._dynamo.config.patch(disable=False):
        # a matmul only: inductor calls ATen for it, so the entry needs no C++ or Triton build (seconds)
        fn = torch.compile(lambda x, w: x @ w, dynamic=False)
        t = time.perf_counter()
        fn(torch.ones(8, 16), torch.ones(16, 16))
        seconds = time.perf_counter() - t
    got = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    return {**got, "cache_dir": cache_dir(), "seconds": round(seconds, 2)}


def machine_record(device: Any = None) -> dict[str, Any]:
    """What every benchmark's JSON says about where it ran: device, CPU, threads, platform, Python
    and library versions, UTC date, the load average, and the command line."""
    import torch

    from bert_mp.core.numerics.precision import device_name, library_versions

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return {
        "command": " ".join(["python", *sys.argv]),
        "device": device_name(device),
        "cpu_model": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "versions": library_versions(),
    }


def write_report(report: dict[str, Any], out: str | Path) -> None:
    """The JSON written whole or not at all (a cut run keeps its previous file), as each result lands."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out)


def write_progress(out: str, device: torch.device, rounds: list[dict], res: dict) -> None:
    """Each run's figures the moment they are measured (``"partial": true``), so a run cut at a
    deadline still leaves every row it finished; the final report replaces this file."""
    from bert_mp.core.numerics.precision import device_name

    done = rounds[0] if rounds else res  # the first round's rows (a later round only refines them)
    report = {"partial": True, "device": device_name(device), "device_type": device.type, "results": done}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".partial")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(out)


def corpus_data(corpus: str, args, work: Path):
    """``bert-mp prepare`` of a corpus shape (built-in documents, or many ~50-token documents as in
    scripts/bench/prepare.py), or synthetic rows: the prepared data and its data section."""
    from dataclasses import replace

    from bert_mp.core.config import Config, DataConfig
    from bert_mp.data.prepare import load_prepared, prepare

    data_cfg = DataConfig(source="builtin", max_seq_length=args.seq, cache_dir=str(work / "data"))
    if corpus == "synthetic":  # random pairs, nothing prepared: a rehearsal of the sequence, not the data
        vocab = getattr(args, "vocab", 30522)
        n = getattr(args, "synthetic_examples", 512)
        return synthetic_prepared(n, args.seq, vocab, -(-vocab // 64) * 64), data_cfg
    if corpus == "short":
        from bench.prepare_parts import write_corpus

        files = write_corpus(work / "short", args.corpus_bytes, "short")
        data_cfg = replace(data_cfg, source="text", paths=[str(f) for f in files])
    elif corpus != "builtin":
        raise SystemExit(f"--corpus {corpus}: choose builtin, short or synthetic")
    return load_prepared(prepare(Config(data=data_cfg))), data_cfg


def cpu_model() -> str:
    """``lscpu``'s model name (the CPU), or the platform's processor string."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
