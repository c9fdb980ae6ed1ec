"""The lever ladder: where a bf16 BERT step's time goes, one lever at a time, in one run.

    python scripts/bench/levers.py --out runs/levers.json [--preset base --seq 128 --micro-batch 256]
        [--levers compile,bf16_norms,cuda_graphs,unpad] [--corpus builtin] [--attention] [--profile]
    python scripts/bench/levers.py --large --out runs/large.json [--large-steps 200]

Ladder: ``bert_mp.pretrain.trainer.train`` (the real loop: data, masking, logging) on the same prepared
examples, padded eager bf16 first, then each lever added on top of the previous row's config
(cumulative), each row written to the JSON the moment it is measured: tokens/s (real tokens),
positions/s (padding included), MFU and step time as ``bert-mp train`` itself logs them, the share of
this machine's own bf16 GEMM rate (``gemm_rate``, measured first, in the same process), peak memory,
compiled graphs and graph breaks, and x previous row. A lever whose row fails is recorded with its
error and left out of the rows after it.

``--extra-levers``: each on top of the ladder's best row alone (``x_best``), e.g. ``token_budget`` (one
static shape), ``varlen`` (its rows with torch's varlen kernel: no attention dropout, a recipe row),
``no_attention_dropout`` (a recipe row), ``coordinate_descent`` and ``max_autotune`` (inductor's
tuning, kept in its cache: TORCHINDUCTOR_CACHE_DIR); ``--late-levers`` the same after the profile and
the attention timings (the longest compiles, which a short budget loses first).

``--attention``: SDPA's kernels (cuDNN, flash, memory-efficient, math, torch's own choice) and
torch's varlen flash kernel timed on the ladder's attention shape, forward + backward, with the padding
mask of real batches: what ``model.attention_kernel=auto`` should pick on this device.

``--profile``: the fastest row that changes no recipe (ladder and extra rows) again under ``torch.profiler`` (scripts/bench/profile_step.py's grouping),
each kernel class's device time per step, plus the idle time: the unprofiled step time minus the
kernels' time (launch gaps, host work the device waits for).

``--large``: BERT-large at seq 512 on packed rows (``data.pack_pairs``, unpadded), bf16 and fp8
(torchao float8), speed rows, then ``--large-steps`` steps of bf16 with two seeds and fp8 with the
first, and fp8's parity verdict against bf16 with the bf16 seed spread as tolerance (the sweep's
rules: ``bert_mp.sweep.parity``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages

import torch  # noqa: E402

LEVERS: dict[str, dict[str, Any]] = {
    # name: the config keys the lever adds to every row after it
    "compile": {"train.compile": "model"},
    "bf16_norms": {"train.layernorm_precision": "autocast"},
    "cuda_graphs": {"train.compile": "model", "train.compile_mode": "reduce-overhead"},
    "max_autotune": {"train.compile": "model", "train.compile_mode": "max-autotune"},
    "unpad": {"model.unpad": True},
    "no_dropout": {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0},
    # NSP pairs packed into full rows at collate time, on the unpadded stream: no padding in the
    # GEMMs, and a stream length that barely moves (one compiled bucket, one CUDA graph)
    "packed": {"data.pack_pairs": True, "model.unpad": True},
    # micro-batches of a fixed token budget: full rows, one shape (one compile, one CUDA graph), each
    # example kept apart by a block-diagonal mask (BERT's attention dropout stays)
    "token_budget": {"data.token_budget": True},
    # those rows with torch's varlen flash kernel, which has no dropout: attention dropout 0
    "varlen": {"data.token_budget": True, "model.attention_probs_dropout_prob": 0.0},
    # MosaicBERT's choice on the padded best row: what attention dropout alone costs
    "no_attention_dropout": {"model.attention_probs_dropout_prob": 0.0},
    "coordinate_descent": {"train.compile": "model", "train.compile_mode": "coordinate-descent"},
}
"""Each lever as config keys. ``no_dropout``, ``no_attention_dropout`` and ``varlen`` change the recipe
(the model trained), not the numerics of the same model: their rows say so, the sweep's verdict
judges the change (``sweep.recipes``), and none is a default."""
RECIPE_LEVERS = ("no_dropout", "no_attention_dropout", "varlen")
DEFAULT_LEVERS = "compile,bf16_norms,cuda_graphs,unpad"


def _write(report: dict, out: Path) -> None:
    from bench.harness import write_report

    write_report(report, out)


def _data(args: argparse.Namespace, work: Path, seq: int = 0, examples: int = 0) -> tuple[Any, Any]:
    """The prepared examples every row trains on: the built-in corpus, or synthetic rows."""
    from bench.harness import corpus_data

    n = examples or args.micro_batch * (args.steps + args.warmup + 2)
    shape = SimpleNamespace(seq=seq or args.seq, corpus_bytes=0, synthetic_examples=n, vocab=args.vocab)
    return corpus_data(args.corpus, shape, work)


def _bench_args(
    args: argparse.Namespace, preset: str, steps: int, warmup: int, seq: int = 0, micro_batch: int = 0
) -> SimpleNamespace:
    return SimpleNamespace(
        preset=preset,
        seq=seq or args.seq,
        micro_batch=micro_batch or args.micro_batch,
        steps=steps,
        warmup=warmup,
        gemm_flops=args.gemm_flops,  # this process's measured bf16 GEMM rate: each row's second ceiling
        dropout_impl="torch",  # the GPU's own; on a CPU rehearsal too, so the graphs are the GPU's
        attn_implementation="sdpa",
        compile="none",
        allow_emulated=args.allow_emulated,
        attention_dropout=None,  # the model's (BERT's 0.1) unless a lever changes it
        device="auto",
    )


def ladder(args: argparse.Namespace, data: Any, data_cfg: Any, work: Path, report: dict, out: Path) -> None:
    """Eager padded, then each lever on top of the rows before it; every row written when measured."""
    from bench.harness import bench_bert_mp

    bargs = _bench_args(args, args.preset, args.steps, args.warmup)
    carried: dict[str, Any] = {}
    names = ["eager", *[x for x in args.levers.split(",") if x]]
    rows = report.setdefault("ladder", [])
    for i, name in enumerate(names):
        if name != "eager" and name not in LEVERS:
            raise SystemExit(f"--levers: {name!r}; choose from {', '.join(LEVERS)}")
        keys = {**carried, **LEVERS.get(name, {})}
        row: dict[str, Any] = {"lever": name, "config": dict(keys), "recipe_change": name in RECIPE_LEVERS}
        t0 = time.perf_counter()
        try:
            res = bench_bert_mp(
                data, bargs, args.precision, work / f"row_{i}_{name}", data_cfg=data_cfg, extra=keys
            )
            row.update({k: v for k, v in res.items() if k != "precision_in_effect"})
            row["layernorm"] = res["precision_in_effect"].get("layernorm")
            carried = keys
        except Exception as e:  # a failed lever is recorded and not carried into the next rows
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        prev = next((r for r in reversed(rows) if r.get("tokens_per_sec")), None)
        if row.get("tokens_per_sec") and prev:
            row["x_previous"] = row["tokens_per_sec"] / prev["tokens_per_sec"]
            row["x_eager"] = (
                row["tokens_per_sec"] / rows[0]["tokens_per_sec"] if rows[0].get("tokens_per_sec") else None
            )
        rows.append(row)
        _write(report, out)
        print(_row_line(row), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def extra_rows(
    args: argparse.Namespace,
    data: Any,
    data_cfg: Any,
    work: Path,
    report: dict,
    out: Path,
    best: dict,
    names: list[str],
) -> None:
    """``--extra-levers`` / ``--late-levers``: each on top of the ladder's best row alone, in
    ``report["extra"]``."""
    from bench.harness import bench_bert_mp

    bargs = _bench_args(args, args.preset, args.steps, args.warmup)
    rows = report.setdefault("extra", [])
    for name in names:
        keys = {**best["config"], **LEVERS[name]}
        row: dict[str, Any] = {
            "lever": f"{best['lever']}+{name}",
            "config": keys,
            "recipe_change": name in RECIPE_LEVERS,
        }
        t0 = time.perf_counter()
        try:
            res = bench_bert_mp(
                data, bargs, args.precision, work / f"extra_{name}", data_cfg=data_cfg, extra=keys
            )
            row.update({k: v for k, v in res.items() if k != "precision_in_effect"})
            row["x_best"] = row["tokens_per_sec"] / best["tokens_per_sec"]
            row["layernorm"] = res["precision_in_effect"].get("layernorm")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        _write(report, out)
        print(_row_line(row), flush=True)


def _row_line(r: dict) -> str:
    if r.get("error"):
        return f"{r['lever']:<14} FAILED {r['error'][:200]}"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    gemm = f"{100 * r['gemm_share']:.1f}%" if r.get("gemm_share") is not None else "n/a"
    return (
        f"{r['lever']:<14} {r['tokens_per_sec']:>12,.0f} tok/s  {r['positions_per_sec']:>12,.0f} positions/s  "
        f"{r['step_ms']:>8.1f} ms  MFU {mfu:>6}  GEMM rate {gemm:>6}  "
        f"x prev {r.get('x_previous') or r.get('x_best') or 1:.2f}  graphs {r.get('compiled_graphs')}  "
        f"breaks {r.get('graph_breaks')}  cudagraph skips {r.get('cudagraph_skips')}"
    )


def best_row(rows: list[dict]) -> dict | None:
    """The fastest row that changed no recipe (what the extra rows build on, and the profile looks at)."""
    ok = [r for r in rows if r.get("tokens_per_sec") and not r.get("recipe_change")]
    return max(ok, key=lambda r: r["tokens_per_sec"]) if ok else None


# --------------------------------------------------------------------------------------------------
# attention kernels
# --------------------------------------------------------------------------------------------------
def attention_kernels(args: argparse.Namespace, lengths: list[int], dropouts: tuple[float, ...]) -> dict:
    """Forward + backward of SDPA per kernel (and the varlen flash kernel) on the ladder's shape."""
    import torch.nn.functional as F

    from bench.harness import time_ms
    from bert_mp.model.attention import attention_backends

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    heads, dim = args.heads, args.head_dim
    b, s = len(lengths), args.seq
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, dim, generator=gen).to(dev, dtype).requires_grad_() for _ in range(3))
    lens = torch.tensor(lengths)
    mask = (torch.arange(s)[None, :] < lens[:, None]).to(dev)[:, None, None, :].expand(b, 1, s, s)
    grad = torch.randn(b, heads, s, dim, generator=gen).to(dev, dtype)
    out: dict[str, Any] = {"shape": {"batch": b, "heads": heads, "seq": s, "head_dim": dim}, "dtype": "bf16"}
    out["padding_fraction"] = 1 - sum(lengths) / (b * s)
    for p in dropouts:
        res: dict[str, Any] = {}
        for kernel in ("auto", "cudnn", "flash_sdpa", "efficient", "math"):
            if kernel == "flash_sdpa":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                ctx = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # noqa: E731
            else:
                ctx = lambda kernel=kernel: attention_backends(kernel)  # noqa: E731

            def step(ctx=ctx, p=p) -> None:
                with ctx():
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
                o.backward(grad)

            try:
                step()  # warm-up (and: does this kernel take a mask and this dropout here?)
                res[kernel] = {"fwd_bwd_ms": time_ms(step, args.attention_reps)}
            except RuntimeError as e:
                res[kernel] = {"unsupported": str(e).splitlines()[0][:300]}
            q.grad = k.grad = v.grad = None
        if p == 0:
            res["varlen_flash"] = _varlen_flash(q, k, v, lens, grad, args.attention_reps)
        ok = {n: r["fwd_bwd_ms"] for n, r in res.items() if "fwd_bwd_ms" in r}
        res["fastest"] = min(ok, key=ok.get) if ok else None
        out[f"dropout_{p:g}"] = res
    return out


def _varlen_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, grad, reps: int
) -> dict:
    """torch's varlen flash kernel on the same tokens, unpadded (CUDA, bf16)."""
    from bench.harness import time_ms

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {"unsupported": "torch.nn.attention.varlen is missing"}
    if not q.is_cuda:
        return {"unsupported": "CUDA only"}
    keep = (torch.arange(q.shape[2])[None, :] < lens[:, None]).reshape(-1).to(q.device)

    def stream(x: torch.Tensor) -> torch.Tensor:
        return x.detach().transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[keep].requires_grad_()

    qs, ks, vs = stream(q), stream(k), stream(v)
    g = grad.transpose(1, 2).reshape(-1, grad.shape[1], grad.shape[3])[keep]
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(q.device, torch.int32)
    m = int(lens.max())

    def step() -> None:
        varlen_attn(qs, ks, vs, cu, cu, m, m).backward(g)

    try:
        step()
        return {"fwd_bwd_ms": time_ms(step, reps)}
    except RuntimeError as e:
        return {"unsupported": str(e).splitlines()[0][:300]}


def batch_lengths(data: Any, n: int) -> list[int]:
    """Real lengths of the first ``n`` training examples (the ladder's first batch)."""
    ds = data.dataset["train"]
    return [len(ds[i]["input_ids"]) for i in range(min(n, len(ds)))]


# --------------------------------------------------------------------------------------------------
# profile of the best row
# --------------------------------------------------------------------------------------------------
def profile_best(args: argparse.Namespace, data: Any, data_cfg: Any, work: Path, best: dict) -> dict:
    """The best row under torch.profiler: kernel classes per step, and the idle time beside them."""
    from bench.profile_step import profile_path

    ns = _bench_args(args, args.preset, args.profile_steps, args.profile_warmup)
    ns.shapes = False
    ns.precision = args.precision
    res = profile_path(data, ns, "padded", work / "profile", extra=best["config"], data_cfg=data_cfg)
    steps = max(1, args.profile_steps)
    per_step = {k: v["device_us"] / 1000 / steps for k, v in res["groups"].items()}
    kernels = sum(per_step.values())
    step_ms = best.get("step_ms")  # the unprofiled row's step time: the profiler slows the host
    res["lever"] = best["lever"]
    res["ms_per_step"] = dict(sorted(per_step.items(), key=lambda kv: -kv[1]))
    res["unprofiled_step_ms"] = step_ms
    res["idle_ms_per_step"] = step_ms - kernels if step_ms else None
    if step_ms:
        res["share_of_step"] = {k: v / step_ms for k, v in res["ms_per_step"].items()}
        res["share_of_step"]["idle (step - kernels)"] = max(0.0, step_ms - kernels) / step_ms
    return res


# --------------------------------------------------------------------------------------------------
# BERT-large, seq 512, packed: bf16 vs fp8
# --------------------------------------------------------------------------------------------------
LARGE_KEYS = {"data.pack_pairs": True, "model.unpad": True, "train.compile": "model"}


def large(args: argparse.Namespace, work: Path, report: dict, out: Path) -> None:
    """Speed rows for bf16 and fp8, then the parity runs and fp8's verdict against bf16."""
    from dataclasses import replace

    from bench.harness import bench_bert_mp

    corpus = args.corpus
    n = args.large_micro_batch * (args.steps + args.warmup + args.large_steps + 2)
    data, data_cfg = _data(args, work / "large", seq=args.large_seq, examples=n)
    data_cfg = replace(data_cfg, pack_pairs=True)
    setup = {"preset": args.large_preset, "seq": args.large_seq, "micro_batch": args.large_micro_batch}
    sec = report.setdefault("large", {"setup": {**setup, "corpus": corpus, **LARGE_KEYS}})
    speed = sec.setdefault("speed", {})
    bargs = _bench_args(
        args, args.large_preset, args.steps, args.warmup, args.large_seq, args.large_micro_batch
    )
    for precision in ("bf16", "fp8"):
        try:
            res = bench_bert_mp(
                data, bargs, precision, work / f"large_{precision}", data_cfg=data_cfg, extra=LARGE_KEYS
            )
            speed[precision] = {k: v for k, v in res.items() if k != "precision_in_effect"}
            speed[precision]["emulated"] = res["precision_in_effect"].get("emulated")
        except Exception as e:
            speed[precision] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        _write(report, out)
        print(
            f"large {precision}: {speed[precision].get('tokens_per_sec') or speed[precision].get('error')}",
            flush=True,
        )
    if speed.get("bf16", {}).get("tokens_per_sec") and speed.get("fp8", {}).get("tokens_per_sec"):
        sec["fp8_speedup"] = speed["fp8"]["tokens_per_sec"] / speed["bf16"]["tokens_per_sec"]
    sec["parity"] = parity(args, data, data_cfg, work, report, out)
    _write(report, out)


def parity(args: argparse.Namespace, data: Any, data_cfg: Any, work: Path, report: dict, out: Path) -> dict:
    """``--large-steps`` steps each of bf16 (seeds 1, 2) and fp8 (seed 1); fp8's verdict against bf16."""
    from bench.harness import bench_bert_mp
    from bert_mp.pretrain.parity_monitor import load_curves
    from bert_mp.sweep.parity import VerdictRules, verdict

    runs = {"bf16": ("bf16", 1), "bf16_seed2": ("bf16", 2), "fp8": ("fp8", 1)}
    bargs = _bench_args(args, args.large_preset, args.large_steps, 0, args.large_seq, args.large_micro_batch)
    done: dict[str, Any] = {}
    for name, (precision, seed) in runs.items():
        keys = {**LARGE_KEYS, "train.seed": seed, "train.eval_every": max(1, args.large_steps // 4)}
        try:
            res = bench_bert_mp(
                data, bargs, precision, work / f"parity_{name}", data_cfg=data_cfg, extra=keys
            )
            done[name] = {"tokens_per_sec": res["tokens_per_sec"], "steps": res["steps"]}
        except Exception as e:
            done[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        report["large"]["parity"] = {"runs": done}
        _write(report, out)
    if any("error" in r for r in done.values()):
        return {"runs": done, "verdict": None}
    rules = VerdictRules(window=max(2, args.large_steps // 20))
    v = verdict(
        load_curves(work / "parity_fp8"),
        load_curves(work / "parity_bf16"),
        load_curves(work / "parity_bf16_seed2"),
        rules,
    )
    return {
        "runs": done,
        "reference": "bf16 (seed 1); tolerance: the bf16 seed spread",
        "verdict": v.to_dict(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/levers.json")
    p.add_argument("--preset", default="base")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row (compilation included)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--levers", default=DEFAULT_LEVERS, help=f"in order, cumulative; from {', '.join(LEVERS)}")
    p.add_argument("--corpus", default="builtin", help="builtin (the prepared built-in corpus) or synthetic")
    p.add_argument("--vocab", type=int, default=30522, help="synthetic rows' vocabulary")
    p.add_argument("--no-ladder", action="store_true")
    p.add_argument("--attention", action="store_true", help="time SDPA's kernels on the ladder's shape")
    p.add_argument("--attention-reps", type=int, default=10)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--extra-levers", default="", help="each of these on top of the ladder's best row alone")
    p.add_argument("--late-levers", default="", help="as --extra-levers, after the profile and --attention")
    p.add_argument("--profile", action="store_true", help="profile the fastest row")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--profile-warmup", type=int, default=3)
    p.add_argument("--large", action="store_true", help="BERT-large seq 512 packed: bf16 vs fp8, and parity")
    p.add_argument("--large-preset", default="large")
    p.add_argument("--large-seq", type=int, default=512)
    p.add_argument("--large-micro-batch", type=int, default=32)
    p.add_argument("--large-steps", type=int, default=200, help="steps of each parity run")
    p.add_argument(
        "--allow-emulated",
        action="store_true",
        help="bf16 / fp8 emulated on a CPU without them (numerics, not speed)",
    )
    p.add_argument(
        "--cache-probe",
        action="store_true",
        help="compile a tiny function with inductor: its cache hit or miss",
    )
    args = p.parse_args()
    from bench.harness import gemm_rate, inductor_probe, machine_record

    out = Path(args.out)
    report: dict[str, Any] = {
        **machine_record(),
        "setup": {
            k: getattr(args, k)
            for k in ("preset", "seq", "micro_batch", "steps", "warmup", "precision", "corpus")
        },
        "note": "tokens/s and MFU as bert-mp train logs them (real tokens); positions/s count padding too; "
        "MFU against the datasheet peak, gemm_share against gemm_rate (measured here); cumulative levers; "
        "x_previous against the last row that ran",
    }
    if args.cache_probe:
        report["cache_probe"] = inductor_probe()
    report["gemm_rate"] = gemm_rate()
    args.gemm_flops = report["gemm_rate"]["flops_per_sec"]
    _write(report, out)
    with tempfile.TemporaryDirectory(prefix="bench_levers_") as tmp:
        run(args, Path(tmp), report, out)
    print(f"wrote {out}")


def run(args: argparse.Namespace, work: Path, report: dict, out: Path) -> None:
    """Ladder, the extra rows on its best row, the profile of the best row of all, the attention kernels,
    the late rows (in this order: a cut loses the last first), then BERT-large."""
    if not args.no_ladder or args.attention or args.profile:
        data, data_cfg = _data(args, work)
    if not args.no_ladder:
        ladder(args, data, data_cfg, work, report, out)
    best = best_row(report.get("ladder") or [])
    if args.extra_levers and best:
        extra_rows(args, data, data_cfg, work, report, out, best, args.extra_levers.split(","))
    top = best_row([*(report.get("ladder") or []), *(report.get("extra") or [])])
    if args.profile and top:
        report["profile"] = profile_best(args, data, data_cfg, work, top)
        _write(report, out)
        print(f"profile of {top['lever']}: {report['profile'].get('share_of_step')}", flush=True)
    if args.attention:
        lengths = batch_lengths(data, args.micro_batch)
        report["attention"] = attention_kernels(args, lengths, (0.1, 0.0))
        _write(report, out)
        for key in ("dropout_0.1", "dropout_0"):
            print(f"attention {key}: fastest {report['attention'][key]['fastest']}", flush=True)
    if args.late_levers and best:
        extra_rows(args, data, data_cfg, work, report, out, best, args.late_levers.split(","))
    if args.large:
        large(args, work, report, out)


if __name__ == "__main__":
    main()
