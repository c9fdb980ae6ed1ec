"""The shared ``accelerate launch`` command line (sweep, scale-out benchmark, multi-process tests)."""

from __future__ import annotations

import sys

from bert_mp.core.launch import accelerate_launch


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
    from bert_mp.core.launch import SHUTDOWN_TIMEOUT_S, run_launcher

    show = [sys.executable, "-c", "import os; print(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])"]
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert run_launcher(show) == 0
    assert capfd.readouterr().out.strip() == str(SHUTDOWN_TIMEOUT_S)
    assert SHUTDOWN_TIMEOUT_S > 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert run_launcher(show) == 0
    assert capfd.readouterr().out.strip() == "45"
