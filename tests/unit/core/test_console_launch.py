"""console lines on the main process only; the ``bert-mp launch`` command line."""

from __future__ import annotations

import sys

import pytest

from bert_mp.core.run import console, launch
from bert_mp.errors import ConfigError


def test_say_prints_on_the_main_process_only_with_the_command_name(monkeypatch, capsys):
    monkeypatch.setattr(console, "_COMMAND", ["train"])
    console.say("reusing data/x", command="prepare")
    console.say("hello")
    monkeypatch.setenv("RANK", "1")
    console.say("from the second process")
    console.show("bert-mp train: stopped")
    assert capsys.readouterr().out == "bert-mp prepare: reusing data/x\nbert-mp train: hello\n"


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
    assert launch.process_count_warning(1) is None
