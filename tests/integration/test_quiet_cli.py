"""Per command the user sees what bert_mp has to say: no library progress bars, load reports or
profiler lines (all of it back under ``--debug``), one start-up line, a skip reason said once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
from support import ROOT, TINY_SWEEP_MODEL, cpu_mask_plus
from support import finetune_overrides as _overrides

from bert_mp.core.numerics import precision

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
for _key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KINETO_LOG_LEVEL", "TRANSFORMERS_VERBOSITY"):
    ENV.pop(_key, None)
ENV.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
ENV.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return forkserver.run(
        [sys.executable, "-m", "bert_mp", *args],
        cwd=cwd,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_finetune_shows_its_own_lines_only_and_the_rest_under_debug(tmp_path, ckpt):
    quiet = _cli("finetune", *_overrides(ckpt, tmp_path / "a", epochs=1), cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    first = quiet.stdout.splitlines()[0]
    cores = len(os.sched_getaffinity(0))
    assert first == (
        f"bert-mp finetune: 1 process x {cores} thread{'s' if cores > 1 else ''} ({cores} cores // 1 process), "
        f"accumulation 1, precision fp32, device cpu ({first.split('device cpu (', 1)[1]}"
    )
    for noise in ("LOAD REPORT", "Map:", "Generating", "Loading weights", "Writing model shards", "%|"):
        assert noise not in quiet.stderr and noise not in quiet.stdout, noise
    assert quiet.stderr.strip() == ""  # a loaded machine's warning goes to stdout, beside the start-up line
    summary = json.loads((tmp_path / "a" / "out" / "summary.json").read_text())
    assert summary["conditions"]["threads"] == cores and summary["conditions"]["processes"] == 1

    # --debug brings the libraries' lines back; the user's own thread count is kept, and the start-up
    # line says whose it is
    loud = _cli(
        "finetune",
        "--debug",
        *_overrides(ckpt, tmp_path / "b", epochs=1),
        cwd=tmp_path,
        env={**ENV, "OMP_NUM_THREADS": "1"},
    )
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "LOAD REPORT" in loud.stderr and "Map:" in loud.stderr
    assert "1 process x 1 thread (OMP_NUM_THREADS=1)" in loud.stdout.splitlines()[0]


PROFILE = """
import sys
from bert_mp.core.process.noise import quiet_libraries
quiet_libraries(debug=sys.argv[1] == "debug")
import torch
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU]):
    torch.ones(4, 4) @ torch.ones(4, 4)
"""


def test_profiler_lines_only_under_debug(tmp_path):
    """The sweep's kernel check runs torch.profiler, whose kineto library prints `USDT: ... profiler_start`."""
    runs = {
        mode: subprocess.run(
            [sys.executable, "-c", PROFILE, mode], env=ENV, capture_output=True, text=True, timeout=300
        )
        for mode in ("quiet", "debug")
    }
    assert runs["quiet"].returncode == 0 and runs["debug"].returncode == 0, runs["quiet"].stderr
    assert "profiler_start" not in runs["quiet"].stderr + runs["quiet"].stdout
    assert "profiler_start" in runs["debug"].stderr + runs["debug"].stdout


def test_sweep_says_a_skip_reason_once_records_conditions_and_stays_quiet(tmp_path, monkeypatch):
    """The real CLI on a CPU without fp16 (masked): fp16 is skipped with its reason printed once; the
    runs record their conditions and the report shows them; no profiler lines. Then fp32 measured
    again with another thread count: bf16's speed-up is no longer quoted. bf16 runs where the CPU
    has it and is skipped, with its own reason, where it has not (an AVX2-only CPU, or the suite
    under BERT_MP_CPU_MASK=all: the mask here adds fp16 to the suite's own)."""
    overrides = [
        f"sweep.output_dir={tmp_path / 'sweep'}",
        "sweep.precisions=[fp32,bf16,fp16]",
        "sweep.profile_steps=1",
        "sweep.parity_window=2",
        f"data.cache_dir={tmp_path / 'data'}",
        "data.max_documents=40",
        *TINY_SWEEP_MODEL,
        "train.max_steps=4",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.warmup_steps=1",
        "train.eval_every=0",
        "train.eval_max_batches=1",
        "train.export=false",
    ]
    mask = cpu_mask_plus("fp16")
    monkeypatch.setenv(precision.CPU_MASK_ENV, mask)
    has_bf16 = precision.cpu_capabilities().bf16  # what the sweep's processes see
    env = {**ENV, precision.CPU_MASK_ENV: mask}
    proc = _cli("sweep", "configs/quickstart_sweep.yaml", *overrides, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "USDT" not in out and "profiler_start" not in out
    assert "\n\n\n" not in proc.stdout  # what the tokenizer trainer writes for its bars without a terminal
    skip = next(ln for ln in proc.stdout.splitlines() if "runs/fp16: skipped: " in ln)
    reason = skip.split("skipped: ", 1)[1]
    assert len(reason) > 40 and out.count(reason) == 1, out
    root = tmp_path / "sweep"
    bf16_skip = [ln for ln in proc.stdout.splitlines() if "runs/bf16: skipped: " in ln]
    if has_bf16:
        assert not bf16_skip and (root / "runs" / "bf16" / "summary.json").is_file(), out
    else:  # skipped with a reason of its own, said once, and nothing trained
        assert len(bf16_skip) == 1 and "bf16" in bf16_skip[0].split("skipped: ", 1)[1], out
        assert not (root / "runs" / "bf16" / "summary.json").exists()
    cond = json.loads((root / "runs" / "fp32" / "summary.json").read_text())["conditions"]
    assert cond["threads"] >= 1 and cond["cores"] == len(os.sched_getaffinity(0))
    assert cond["load_start"] is not None and cond["load_end"] is not None
    assert "bert-mp train: 1 process x" in (root / "runs" / "fp32" / "launch.log").read_text()
    assert "Run conditions" in (root / "report.md").read_text()

    # sweep.rerun trains a completed run again and keeps the others: here with one thread, so the
    # reference no longer matches bf16's conditions (measured with every core)
    again = _cli(
        "sweep",
        "configs/quickstart_sweep.yaml",
        *overrides,
        "sweep.rerun=[fp32]",
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs/fp32: completed earlier, training it again (sweep.rerun)" in again.stdout
    assert "runs/fp32-seed43: completed earlier, kept" in again.stdout
    cond = json.loads((root / "runs" / "fp32" / "summary.json").read_text())["conditions"]
    assert cond["threads"] == 1 and cond["threads_source"] == "OMP_NUM_THREADS=1"
    if not has_bf16:
        return
    bf16 = json.loads((root / "runs" / "bf16" / "summary.json").read_text())["conditions"]
    if bf16["threads"] != 1:  # bf16 ran on more than one core
        line = next(ln for ln in again.stdout.splitlines() if ln.strip().startswith("bf16 "))
        assert "speed not compared" in line
        assert f"threads {bf16['threads']} vs 1" in (root / "report.md").read_text()
