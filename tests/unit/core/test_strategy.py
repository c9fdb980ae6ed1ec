"""The strategy a launch asks for, what runs, and what is refused in one line; the machines of a launch
and the stop flag that names a signal."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bert_mp.core.config import load_config
from bert_mp.core.engine import strategy
from bert_mp.core.loop.state import flag_signal, signal_flag
from bert_mp.errors import ConfigError

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer",
}


def _state(world: int, kind: str = "MULTI_CPU", backend: str | None = "gloo", stage: int | None = None):
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}}) if stage else None
    return SimpleNamespace(
        num_processes=world, distributed_type=kind, backend=backend, deepspeed_plugin=plugin
    )


def test_the_launch_request_is_read_from_accelerate_launchs_environment():
    assert strategy.launch_request({}) == strategy.Request("ddp")
    r = strategy.launch_request({**FSDP_ENV, "FSDP_RESHARD_AFTER_FORWARD": "false"})
    assert (r.engine, r.fsdp_version, r.reshard_after_forward, r.layer_classes) == (
        "fsdp",
        2,
        False,
        ("BertLayer",),
    )
    ds = strategy.launch_request({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"})
    assert (ds.engine, ds.zero_stage) == ("deepspeed", 1)


def test_what_runs_is_named_with_what_it_shards():
    single = strategy.strategy_in_force(_state(1, "NO", None), strategy.Request(), cuda=False)
    assert (single.name, single.label(), single.backend) == ("single", "single process", None)
    ddp = strategy.strategy_in_force(_state(2), strategy.Request(), cuda=False)
    assert ddp.label() == "DDP (nothing sharded; gloo)" and not ddp.parameters_sharded
    fsdp = strategy.strategy_in_force(_state(4), strategy.launch_request(FSDP_ENV), cuda=False)
    assert (
        fsdp.label() == "FSDP2 (parameters, gradients and optimizer state sharded; bert_mp fully_shard, gloo)"
    )
    assert fsdp.to_dict()["parameters_sharded"] and fsdp.to_dict()["sharded"][0] == "parameters"
    zero2 = strategy.strategy_in_force(
        _state(2, "DEEPSPEED", stage=2), strategy.Request("deepspeed"), cuda=False
    )
    assert zero2.label() == "DeepSpeed ZeRO-2 (gradients and optimizer state sharded, parameters whole; gloo)"


def test_deepspeed_on_a_cpu_launch_gets_gloo_not_cpu_true(monkeypatch):
    monkeypatch.setattr(strategy, "deepspeed_installed", lambda: True)
    assert strategy.state_options(strategy.Request("deepspeed"), cuda=False) == {
        "cpu": False,
        "backend": "gloo",
    }
    assert strategy.state_options(strategy.Request(), cuda=False) == {"cpu": True}
    assert strategy.state_options(strategy.Request("deepspeed"), cuda=True) == {"cpu": False}


@pytest.mark.parametrize(
    ("env", "overrides", "said"),
    [
        ({}, ["train.strategy=fsdp"], "train.strategy=fsdp: this launch gives single process; launch with"),
        ({**FSDP_ENV, "FSDP_VERSION": "1"}, [], "fsdp_version: 1 in the accelerate config"),
        (
            {**FSDP_ENV, "FSDP_OFFLOAD_PARAMS": "true"},
            [],
            "fsdp_offload_params: true in the accelerate config",
        ),
        (
            {**FSDP_ENV, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"},
            [],
            "fsdp_state_dict_type: FULL_STATE_DICT",
        ),
        (FSDP_ENV, ["train.precision=fp16"], "train.precision=fp16 is not supported under FSDP on CPU"),
        (FSDP_ENV, ["train.optimizer=lamb"], "train.optimizer=lamb is not supported under FSDP on CPU"),
        (FSDP_ENV, ["train.compile=model"], "train.compile=model is not supported under FSDP on CPU"),
    ],
    ids=["strategy-key", "fsdp1", "offload", "full-state-dict", "fp16", "lamb", "compile"],
)
def test_what_the_launch_cannot_give_is_one_line_naming_the_key(env, overrides, said):
    cfg = load_config(None, overrides)
    request = strategy.launch_request(env)
    world = 1 if not env else 2
    in_force = strategy.strategy_in_force(
        _state(world, "NO" if world == 1 else "MULTI_CPU"), request, cuda=False
    )
    with pytest.raises(ConfigError) as e:
        strategy.check_request(request, cfg.train, in_force, cuda=False, command="train")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_fsdp_on_cpu_is_for_train_only_and_deepspeed_must_be_installed(monkeypatch):
    cfg = load_config(None, [])
    request = strategy.launch_request(FSDP_ENV)
    in_force = strategy.strategy_in_force(_state(2), request, cuda=False)
    with pytest.raises(ConfigError, match="runs `bert-mp train` only"):
        strategy.check_request(request, cfg.finetune, in_force, cuda=False, command="finetune")
    monkeypatch.setattr(strategy, "deepspeed_installed", lambda: False)
    with pytest.raises(ConfigError, match="deepspeed is not installed"):
        strategy.check_request(
            strategy.Request("deepspeed"), cfg.train, in_force, cuda=False, command="train"
        )


def test_a_forced_strategy_on_a_plain_train_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bert_mp",
            "train",
            "train.strategy=deepspeed",
            f"train.output_dir={tmp_path}/r",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "bert-mp train: error: train.strategy=deepspeed: this launch gives single process; "
        "launch with `bert-mp launch --config_file configs/accelerate/deepspeed_zero2.yaml --num_processes N "
        "train ...`, or set train.strategy=auto"
    ]


def test_the_stop_flag_names_the_signal_some_rank_got():
    assert signal_flag(None) == 0.0 and flag_signal(0.0) is None
    assert flag_signal(signal_flag("SIGINT")) == "SIGINT"
    assert flag_signal(signal_flag("SIGTERM") + 3 * signal_flag(None)) == "SIGTERM"
    assert flag_signal(2 * signal_flag("SIGINT") + signal_flag("SIGTERM")) == "SIGTERM"  # mixed: SIGTERM wins
    assert flag_signal(7 * signal_flag("SIGINT")) == "SIGINT"
    # a rank whose launcher is gone wins; 1023 ranks' SIGTERM and SIGINT together never read as it
    import numpy as np

    most = np.float32(1023 * signal_flag("SIGTERM")) + np.float32(1023 * signal_flag("SIGINT"))
    assert flag_signal(float(most)) == "SIGTERM"
    assert flag_signal(float(np.float32(signal_flag("launcher gone")) + most)) == "launcher gone"


@pytest.mark.parametrize(
    ("pending", "flag", "reason"),
    [
        (None, 1024.0, "signal SIGTERM"),
        (None, 2.0, "signal SIGINT"),
        ("SIGINT", 1025.0, "signal SIGINT"),
        (None, 0.0, "signal on another rank"),
    ],
)
def test_a_stop_from_another_rank_records_the_signal_its_flag_names(pending, flag, reason):
    """A rank that got no signal itself records the one the all-reduced flag names (its own wins)."""
    from bert_mp.core.loop.skeleton import TrainingLoop
    from bert_mp.core.loop.state import LoopState

    state = LoopState(pending_signal=pending)
    TrainingLoop.stop_for_signal(SimpleNamespace(state=state), flag)
    assert state.stop_reason == reason


def test_unwrapping_imports_no_deepspeed_until_a_run_has_imported_it(monkeypatch):
    """Accelerate's unwrapping asks whether DeepSpeed is installed and imports it to test the model
    against its engine; bert_mp answers "no" until ``deepspeed`` is imported (an engine needs it)."""
    import importlib.machinery
    import types

    from accelerate.utils import extract_model_from_parallel, other

    from bert_mp.core.engine.accelerator import deepspeed_only_once_imported

    # Accelerate's own check (a run earlier in this process may have answered it already)
    installed = getattr(other.is_deepspeed_available, "__wrapped__", other.is_deepspeed_available)
    was = installed()
    monkeypatch.setattr(other, "is_deepspeed_available", installed)  # undone after the test

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "deepspeed":
                raise ImportError(f"imported {name}")

    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    with pytest.raises(ImportError):
        if not was:
            raise ImportError("deepspeed not installed: Accelerate would not import it either")
        extract_model_from_parallel(torch.nn.Linear(2, 2))  # Accelerate's own check: imports it
    deepspeed_only_once_imported()
    deepspeed_only_once_imported()  # a second Accelerator: the same answer, wrapped once
    assert other.is_deepspeed_available.__wrapped__ is installed
    model = torch.nn.Linear(2, 2)
    assert extract_model_from_parallel(model) is model and other.is_deepspeed_available() is False
    imported = types.ModuleType("deepspeed")
    imported.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed", imported)
    assert other.is_deepspeed_available() is was
