"""The shared ``accelerate launch`` command line (sweep, scale-out benchmark, multi-process tests)."""

from __future__ import annotations

import sys

from bert_mp.core.run.launch import accelerate_launch


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_n_processes_on_a_cpu_are_spawned_torchrun_style():
    cmd = accelerate_launch(2, cuda=False, port=29555)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    # `--cpu --num_processes 2` would start ONE process in Accelerate 1.x
    assert "--multi_gpu" in cmd and "--cpu" not in cmd
    assert _value(cmd, "--num_processes") == "2" and _value(cmd, "--num_machines") == "1"
    assert _value(cmd, "--mixed_precision") == "no" and _value(cmd, "--main_process_port") == "29555"
    one = accelerate_launch(1, cuda=False)
    assert "--cpu" in one and "--multi_gpu" not in one and "--main_process_port" not in one


def test_a_config_file_or_explicit_flags_win():
    cmd = accelerate_launch(2, cuda=False, extra=["--config_file", "c.yaml"])
    assert cmd[-2:] == ["--config_file", "c.yaml"]
    assert not {"--multi_gpu", "--cpu", "--num_machines", "--mixed_precision"} & set(cmd)
    cuda = accelerate_launch(4, cuda=True, extra=["--num_machines=2"])
    assert not {"--multi_gpu", "--cpu"} & set(cuda) and "--num_machines" not in cuda


def test_the_launcher_gives_the_ranks_time_to_save_after_a_signal(monkeypatch, capfd):
    """torch elastic kills the ranks 30 s after it passes a signal on unless told otherwise; a
    checkpoint on a loaded machine (or of a large model) takes longer. The launcher is started with
    a longer grace period, and a value the user set is kept."""
    from bert_mp.core.run.launch import SHUTDOWN_TIMEOUT_S, run_launcher

    show = [sys.executable, "-c", "import os; print(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])"]
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert run_launcher(show) == 0
    assert capfd.readouterr().out.strip() == str(SHUTDOWN_TIMEOUT_S)
    assert SHUTDOWN_TIMEOUT_S > 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert run_launcher(show) == 0
    assert capfd.readouterr().out.strip() == "45"


# a stand-in for `accelerate launch`: two "ranks" meet the same mistake (each leaves its line as
# bert_mp's CLI does), then the launcher reports the failed children with a traceback and exits 1
FAKE_LAUNCHER = r"""
import os, sys
from bert_mp.core.run import console
for rank in ("1", "0"):
    os.environ["RANK"] = rank
    console.error("bert-mp train: error: train.global_batch_size=32 must be ... (rank %s)" % rank, 2)
sys.stderr.write("W1128 torch/distributed/elastic: Sending process 7 closing signal SIGTERM\n")
sys.stderr.write("Traceback (most recent call last):\n  File x\n")
sys.stderr.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\nbert_mp FAILED\n")
sys.exit(1)
"""


def test_a_mistake_the_ranks_meet_is_one_line_from_one_rank_and_exit_2(capfd):
    from bert_mp.core.run.launch import run_launcher

    assert run_launcher([sys.executable, "-c", FAKE_LAUNCHER]) == 2
    err = capfd.readouterr().err
    assert err == "bert-mp train: error: train.global_batch_size=32 must be ... (rank 0)\n", err


def test_what_a_failing_launcher_says_otherwise_is_shown_as_it_is(capfd):
    """No rank left a line (a crash, not a mistake in the input): the launcher's exit code and all it said."""
    from bert_mp.core.run.launch import run_launcher

    crash = "import sys; sys.stderr.write('Traceback (most recent call last):\\nValueError: boom\\n'); sys.exit(1)"
    assert run_launcher([sys.executable, "-c", crash]) == 1
    assert capfd.readouterr().err == "Traceback (most recent call last):\nValueError: boom\n"


def test_an_error_line_is_one_write_outside_a_launch(monkeypatch, capfd):
    from bert_mp.core.run import console

    monkeypatch.delenv(console.LAUNCH_ERRORS_ENV, raising=False)
    console.error("bert-mp train: error: x", 2)
    assert capfd.readouterr().err == "bert-mp train: error: x\n"


def test_a_global_batch_the_processes_cannot_split_names_a_value_that_works():
    import pytest

    from bert_mp.core.loop.state import BatchGeometry
    from bert_mp.errors import ConfigError

    keys = ("train.global_batch_size", "train.micro_batch_size")
    with pytest.raises(ConfigError) as err:
        BatchGeometry.build(32, 32, 2, *keys)
    assert str(err.value) == (
        "train.global_batch_size=32 must be a multiple of train.micro_batch_size (32) x processes (2); "
        "with 2 processes set train.micro_batch_size=16 (accumulation 1), or change train.global_batch_size"
    )
    with pytest.raises(ConfigError, match=r"set train.micro_batch_size=12 \(accumulation 2\)"):
        BatchGeometry.build(48, 16, 2, *keys)  # 24 per process: 16 does not divide it, 12 does
    with pytest.raises(ConfigError, match=r"; set train.global_batch_size=36 \(a multiple of 4 x 3\)$"):
        BatchGeometry.build(32, 4, 3, *keys)  # no micro-batch splits 32 over 3 processes
    assert BatchGeometry.build(32, 16, 2, *keys).accumulation == 1
