"""Two machines on one host, and FSDP stopped by a signal, through the real ``bert-mp launch``.

Each "machine" is one ``bert-mp launch --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1
--main_process_port P --num_processes 4 ...`` (accelerate's ``--num_processes`` counts every machine's
processes), both in the same folder: the shared storage a multi-machine run needs for its run folder
and prepared data. A signal lands while the main rank holds after step 2 (``BERT_MP_HOLD``), so the
order - running, then signalled - holds at any machine speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from support import (
    LAUNCH_DATA,
    LAUNCH_MODEL,
    ROOT,
    all_ended,
    free_port,
    hold_env,
    ignored_signals,
    launch_env,
    launch_project,
    launch_ranks,
    start_cli,
    wait_held,
)

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.storage.files import read_jsonl

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")

TRAIN = [
    *LAUNCH_DATA,
    *LAUNCH_MODEL,
    "model.hidden_dropout_prob=0",
    "model.attention_probs_dropout_prob=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_max_batches=1",
    "train.progress_bar=false",
]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """corpus/a.txt, tok/ and the prepared data/<key>/ (every run reuses it)."""
    return launch_project(tmp_path_factory.mktemp("machines"))


def _machine(
    project: Path,
    rank: int,
    port: int,
    out: str,
    *overrides: str,
    options: tuple = (),
    env: dict | None = None,
    processes: int = 4,
) -> subprocess.Popen:
    """One machine's ``bert-mp launch`` of half the run's ``processes`` (``options``: more launch options)."""
    args = ["launch", "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
    args += ["--main_process_port", str(port), "--num_processes", str(processes), *options]
    args += ["train", *TRAIN, f"train.output_dir={out}", *overrides]
    return start_cli(*args, cwd=project, env=env or launch_env())


def _losses(folder: Path, key: str = "loss/total", kind: str = "train") -> list[float]:
    return [r[key] for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == kind]


def test_two_machines_of_two_processes_train_like_one_process(project, monkeypatch):
    """Machine 1's ranks are the run's ranks 2 and 3: the 2 x 2 launch against one process (in this
    process) accumulating the same 4 micro-batches of 2 - the losses, the evaluation and the weights agree
    to fp32 round-off (the summation order). A rank of machine 1 that took a local rank's place (a
    shard read twice, another missed) would train on other rows and miss by far more."""
    from bert_mp.core.config import load_config
    from bert_mp.pretrain.trainer import train

    port = free_port()
    second = _machine(project, 1, port, "two", "train.max_steps=4")
    first = _machine(project, 0, port, "two", "train.max_steps=4")
    outs = [p.communicate(timeout=600) for p in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), outs
    monkeypatch.chdir(project)
    summary = train(load_config(None, [*TRAIN, "train.output_dir=one", "train.max_steps=4"]))
    assert (summary["batch"]["processes"], summary["batch"]["accumulation"]) == (1, 4)
    two, one = project / "two", project / "one"
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5, abs=1e-6) and len(_losses(one)) == 4
    evals = [_losses(f, "eval/loss_mlm", "eval") for f in (one, two)]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5) and evals[0]
    a, b = (load_file(str(f / "final" / "model.safetensors")) for f in (one, two))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    strategy = json.loads((two / "summary.json").read_text())["strategy"]
    assert (strategy["name"], strategy["processes"], strategy["machines"]) == ("ddp", 4, 2)
    assert "2 machines" in outs[0][0].splitlines()[0]  # the start-up line, from machine 0
    assert outs[1][0].strip() == ""  # machine 1 has no main process: its launcher prints nothing


@pytest.mark.signals
def test_sigterm_on_one_machine_stops_both_with_a_checkpoint_and_exit_143(project):
    """SIGTERM reaches machine 1 only; its ranks pass the stop on in the next step's all-reduce, every
    rank saves the checkpoint together, and machine 0's first rank hands the signal to its own
    launcher: both `bert-mp launch` exit 143; machine 0 prints the stopped line.

    The race this drill met: machine 0's second rank exits 143 once saved, and torch elastic's agent
    then sends SIGTERM to the first, whose stopped line is still to come. The first rank holds there
    (``stopped``: saved, summary written, the stop passed on): it ignores SIGTERM and SIGINT by then,
    as the real launch's environment decides, and the agent's SIGTERM - sent again here once the
    second rank has ended, so that one surely lands in that window - leaves its line and exit."""
    port, ready, started = free_port(), project / "held_machines", []
    hold = launch_env(**hold_env("step:2,stopped", ready))
    first = _machine(project, 0, port, "sig", "train.max_steps=100000", env=hold)
    second = _machine(project, 1, port, "sig", "train.max_steps=100000")
    try:
        wait_held(first, ready)
        ranks = launch_ranks(first, started)  # machine 0's: the run's ranks 0 and 1
        os.kill(second.pid, signal.SIGTERM)  # a job scheduler's SIGTERM, to one machine
        ready.unlink()  # machine 0 goes on: the stop reaches it through the all-reduced flag
        wait_held(first, ready)  # rank 0 saved, wrote the summary, passed the stop on: at `stopped`
        assert {signal.SIGTERM, signal.SIGINT} <= ignored_signals(ranks[0].pid)
        assert all_ended([ranks[1]], timeout=300)  # exited 143: the agent's SIGTERM to rank 0 follows
        ranks[0].send_signal(signal.SIGTERM)  # the agent's, at the latest in this window
        ready.unlink()
        outs = [p.communicate(timeout=600) for p in (first, second)]
    finally:
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert (first.returncode, second.returncode) == (143, 143), outs
    summary = json.loads((project / "sig" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stop_reason"] == "signal SIGTERM"
    saved = ckpt.list_checkpoints(project / "sig" / "checkpoints")
    assert [p.name for p in saved] == [ckpt.checkpoint_name(summary["steps"])]
    assert ckpt.verify(saved[0]) is None
    assert sorted(p.name for p in saved[0].glob("rng_state_*")) == [
        f"rng_state_{r}.safetensors" for r in range(4)
    ]
    said = [line for line in outs[0][0].splitlines() if line.startswith("bert-mp train: stopped")]
    assert said == [
        f"bert-mp train: stopped after {summary['steps']} steps (signal SIGTERM; checkpoint saved) -> sig; "
        "continue it with the same command and train.resume=latest"
    ], outs[0][0]
    for _, err in outs:
        assert "Traceback" not in err and "SignalException" not in err, err[-3000:]


@pytest.mark.parametrize(
    ("rank", "said"), [(0, "machine 1 of 2 did not join within 2 s"), (1, "machine 0 did not answer")]
)
def test_a_machine_that_never_joins_ends_the_other_after_the_timeout_with_one_line(project, rank, said):
    proc = _machine(project, rank, free_port(), "never", "train.max_steps=4", options=("--join_timeout", "2"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert err.splitlines() == [
        line for line in err.splitlines() if line.startswith("bert-mp launch: error: ")
    ]
    assert len(err.splitlines()) == 1 and said in err, err
    assert not (project / "never").exists()  # nothing started


@pytest.mark.signals
def test_fsdp_launch_stops_on_sigterm_with_a_sharded_checkpoint_and_exit_143(project):
    ready = project / "held_fsdp"
    fsdp = str(ROOT / "configs" / "accelerate" / "fsdp.yaml")
    args = ["launch", "--config_file", fsdp, "--num_processes", "2", "--main_process_port", str(free_port())]
    args += ["train", *TRAIN, "train.output_dir=fsdp_sig", "train.max_steps=100000"]
    proc = start_cli(*args, cwd=project, env=launch_env(**hold_env("step:2", ready)))
    wait_held(proc, ready)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, (out[-3000:], err[-3000:])
    summary = json.loads((project / "fsdp_sig" / "summary.json").read_text())
    assert (summary["status"], summary["stop_reason"], summary["strategy"]["name"]) == (
        "stopped",
        "signal SIGTERM",
        "fsdp",
    )
    folder = project / "fsdp_sig" / "checkpoints" / ckpt.checkpoint_name(summary["steps"])
    assert ckpt.verify(folder) is None and len(list((folder / "sharded").iterdir())) == 2
