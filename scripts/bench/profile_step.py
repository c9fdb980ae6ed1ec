"""Where a bert_mp training step spends its device time: kernels grouped by kind, per path.

    python scripts/bench/profile_step.py --out runs/profile_step.json [--preset base --micro-batch 256]
        [--paths padded,unpad,unpad+compile] [--steps 6]

Runs ``bert_mp.pretrain.trainer.train`` (the same call as ``scripts/bench/train.py``, synthetic rows
of ``--seq``) under ``torch.profiler`` and sums each kernel's device time into a group (GEMM,
attention, normalization, softmax / dropout / GELU / other elementwise, optimizer, copies, reductions,
compiled fusions: triton on CUDA, inductor's C++ kernels on a CPU). On a CPU the time is each
op's self CPU time. The profiler records only the ``--steps`` optimizer steps after the
``--warmup`` ones (a schedule stepped from the shared loop's optimizer step): compilation, autotuning
and the final checkpoint's copies stay outside the window. User annotations are not kernels and are
not counted. The JSON is written after each path, as it is measured.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bert_mp.core.process.noise import quiet_libraries  # noqa: E402

quiet_libraries()  # the libraries' chatter off the console, before they load, as `bert-mp` does

import torch  # noqa: E402

GROUPS = (
    ("attention", r"fmha|flash|sdpa|attention|cutlassF|cutlassB"),
    ("gemm", r"gemm|nvjet|xmma|sm\d+_.*tensorop|cublas|matmul|addmm|mm_|aten::mm$|aten::bmm$|mkldnn"),
    # optimi's Triton kernels are _adam_kernel, _stableadamw_*_kernel, _lion_kernel
    ("optimizer", r"multi_tensor|foreach|adam|lion|fused_.*optim"),
    ("compiled fusion", r"^triton_|triton|cpp_fused|kernel_cpp"),
    ("layernorm", r"layer_norm|layernorm|LayerNorm"),
    ("softmax / log-softmax", r"softmax"),
    ("dropout / rng", r"dropout|philox|fused_dropout|bernoulli|rand"),
    ("gelu", r"gelu"),
    ("copy / cast", r"copy|cast|to_copy|memcpy|Memcpy|convert"),
    ("reduction", r"reduce|sum|norm"),
    ("gather / scatter / index", r"index|gather|scatter|embedding"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
)


def group(name: str) -> str:
    for label, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile_path(data, args, path: str, out: Path, extra: dict | None = None, data_cfg=None) -> dict:
    """One ``--paths`` entry (``PATH`` or ``PATH:PRECISION``) profiled over its timed steps; ``extra``:
    dotted config keys on top (as ``bench_bert_mp`` takes them), ``data_cfg``: a prepared corpus's
    data section (default: the synthetic rows)."""
    from bench.harness import bench_bert_mp

    run_name = path.replace(":", "_")

    path, _, precision = path.partition(":")  # "padded:bf16_pure": that path in another precision
    precision = precision or args.precision
    if path not in ("padded", "unpad", "unpad+compile", "padded+compile"):
        raise SystemExit(
            f"--paths: {path!r}; choose padded, unpad, unpad+compile or padded+compile (:PRECISION)"
        )
    unpad = path.startswith("unpad")
    compile_mode = "model" if path.endswith("+compile") else "none"
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:  # inductor's C++ kernels record themselves as profiler events (compiled paths)
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    import bert_mp.core.loop.skeleton as loop

    events: list = []
    schedule = torch.profiler.schedule(wait=args.warmup, warmup=0, active=args.steps, repeat=1)
    prof = torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=lambda p: events.extend(p.events()),
        record_shapes=args.shapes,
    )
    step = loop.optimizer_step

    def stepped(*a, **kw):
        result = step(*a, **kw)
        prof.step()  # the window: the optimizer steps after the warm-up ones
        return result

    loop.optimizer_step = stepped
    t0 = time.perf_counter()
    try:
        with prof:
            res = bench_bert_mp(
                data,
                args,
                precision,
                out / run_name,
                data_cfg=data_cfg,
                unpad=unpad,
                compile_mode=compile_mode,
                extra=extra,
            )
    finally:
        loop.optimizer_step = step
    wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    for evt in events:
        if evt.is_user_annotation:
            continue
        if cuda and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time
        elif not cuda and evt.device_type == torch.autograd.DeviceType.CPU and evt.self_cpu_time_total > 0:
            name = f"{evt.name} {evt.input_shapes}" if args.shapes and evt.input_shapes else evt.name
            kernels[name] = kernels.get(name, 0.0) + evt.self_cpu_time_total
    total = sum(kernels.values())
    groups: dict[str, float] = {}
    for name, us in kernels.items():
        groups[group(name)] = groups.get(group(name), 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "precision": precision,
        "bench": {k: v for k, v in res.items() if k != "precision_in_effect"},
        "profiled_wall_s": wall,
        "profiled_steps": args.steps,
        "profiled_events": len(events),
        "profiled_optimizer_steps": sum(1 for e in events if e.name.startswith("Optimizer.step#")),
        "time": "CUDA kernels' device time" if cuda else "CPU ops' self time (inductor kernels by name)",
        "device_us_total": total,
        "device_ms_per_step": total / 1000 / max(args.steps, 1),
        # kernel time over the step's wall time (under the profiler): well below 1 on a GPU, the
        # device waits for the host (launches, syncs); on a CPU ops overlap threads, so it is a ratio
        "busy_fraction": (total / 1000 / max(args.steps, 1)) / res["step_ms"] if res.get("step_ms") else None,
        "groups": {
            k: {"device_us": v, "share": v / total if total else None}
            for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [{"kernel": k[:160], "group": group(k), "device_us": v} for k, v in top],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mini")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default="bf16")
    p.add_argument(
        "--paths",
        default="padded,unpad,unpad+compile",
        help="comma-separated padded, unpad, unpad+compile, padded+compile; PATH:PRECISION runs that path "
        "in another precision than --precision (e.g. padded:bf16_pure)",
    )
    p.add_argument("--out", default="runs/profile_step.json")
    p.add_argument("--allow-emulated", action="store_true")
    p.add_argument("--shapes", action="store_true", help="CPU: one line per op and input shapes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.harness import synthetic_prepared

    ns = SimpleNamespace(
        preset=args.preset,
        seq=args.seq,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=args.warmup,
        dropout_impl="auto",
        device="auto",
        attn_implementation="sdpa",
        compile="none",
        allow_emulated=args.allow_emulated,
        attention_dropout=0.0,
        precision=args.precision,
        shapes=args.shapes,
    )
    data = synthetic_prepared(args.micro_batch * (args.steps + args.warmup + 2), args.seq, 30522, 30528)
    work = Path(tempfile.mkdtemp(prefix="profile_step_"))  # the runs themselves are not kept
    report = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"torch": torch.__version__},
        "note": "device time of the kernels of the timed optimizer steps (after the warm-up steps; the profiler slows the step)",
        "paths": {},
    }
    for path in args.paths.split(","):
        report["paths"][path] = profile_path(data, ns, path, work)
        Path(args.out).write_text(json.dumps(report, indent=1))
        g = report["paths"][path]["groups"]
        shutil.rmtree(work / path.replace(":", "_"), ignore_errors=True)
        print(
            path,
            report["paths"][path]["bench"].get("tokens_per_sec"),
            {k: round(v["share"], 3) for k, v in g.items()},
            flush=True,
        )


if __name__ == "__main__":
    main()
