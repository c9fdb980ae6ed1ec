"""The ``bert-mp launch`` command line: its options, its command, N CPU processes."""

from __future__ import annotations

import sys

import pytest

from bert_mp.core.process import spawn
from bert_mp.errors import ConfigError
from bert_mp.launch import command as launch
from bert_mp.launch import machines


def test_launch_splits_accelerate_options_from_the_command():
    assert launch.split_launch_args(["--num_processes", "2", "train", "a.yaml", "x=1"]) == (
        ["--num_processes", "2"],
        "train",
        ["a.yaml", "x=1"],
    )
    with pytest.raises(ConfigError, match="name the command to launch"):
        launch.split_launch_args(["--num_processes", "2"])


def test_launch_on_cpu_starts_n_processes_with_torchrun_style_spawning():
    argv = launch.launch_argv(
        ["--num_processes=2", "--main_process_port", "29999"], "train", ["x=1"], cuda=False
    )
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert "--multi_gpu" in argv and "--cpu" not in argv  # --cpu would start one process
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert argv[-4:] == ["-m", "bert_mp", "train", "x=1"]
    plain = launch.launch_argv(["--config_file", "c.yaml"], "finetune", [], cuda=False)
    assert plain == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "c.yaml",
        "-m",
        "bert_mp",
        "finetune",
    ]


def test_no_process_count_warning_outside_accelerate_launch(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert spawn.process_count_warning(1) is None


def test_machines_are_read_from_the_options_over_the_config_file(tmp_path):
    cfg = tmp_path / "multi.yaml"
    cfg.write_text("num_machines: 2\nmachine_rank: 0\nmain_process_ip: 10.1.2.3\nmain_process_port: 29500\n")
    m = machines.machines_of(["--config_file", str(cfg), "--machine_rank", "1", "--main_process_port=1234"])
    assert m == machines.Machines(2, 1, "10.1.2.3", 1234)
    assert machines.machines_of(["--num_processes", "2"]) is None
    with pytest.raises(ConfigError, match="--machine_rank 2: must be 0 to 1"):
        machines.machines_of(["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h"])
    assert machines.pop_join_timeout(["--join_timeout", "5", "--x"]) == (5.0, ["--x"])
    with pytest.raises(ConfigError, match="--join_timeout"):
        machines.pop_join_timeout(["--join_timeout=soon"])
