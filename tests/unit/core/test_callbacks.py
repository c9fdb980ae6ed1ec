"""core/loop/callbacks.py and pretrain/monitors.py: registry, FLOPs / MFU arithmetic, monitors' keys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bert_mp.core.config import Config, TrainConfig
from bert_mp.core.loop.callbacks import LossScaleMonitor, MemoryMonitor
from bert_mp.errors import ConfigError
from bert_mp.pretrain.monitors import (
    REGISTRY,
    LossMonitor,
    PretrainContext,
    StepFacts,
    ThroughputMonitor,
    build_callbacks,
    peak_flops,
    step_flops,
)


def _facts(**kw) -> StepFacts:
    base = dict(
        mlm_loss_sum=30.0,
        mlm_correct=5.0,
        mlm_count=10.0,
        nsp_loss_sum=2.0,
        nsp_correct=3.0,
        nsp_count=4.0,
        tokens=400,
        padded_tokens=512,
        attention_flops_tokens=4 * 128**2,
        sequences=4,
        lr=1e-3,
        grad_norm=0.5,
        step_time_s=0.5,
        data_wait_s=0.1,
    )
    base.update(kw)
    return StepFacts(**base)


def _ctx(
    cfg: Config, device_name: str = "NVIDIA H100 80GB HBM3", precision: str = "bf16", **kw
) -> PretrainContext:
    counts = {
        "encoder_matmul": 1000,
        "pooler_matmul": 16,
        "mlm_transform_matmul": 16,
        "mlm_decoder_matmul": 400,
        "nsp_matmul": 8,
    }
    args = dict(
        cfg=cfg,
        device=torch.device("cpu"),
        precision={"name": precision, "device_name": device_name},
        param_counts=counts,
        hidden_size=4,
        num_layers=2,
        vocab_size=100,
        num_processes=1,
        is_main_process=True,
    )
    args.update(kw)
    return PretrainContext(**args)


def test_registry_builds_by_name_in_order():
    cfg = Config(train=TrainConfig(callbacks=["loss", "throughput"]))
    cbs = build_callbacks(cfg)
    assert [type(c) for c in cbs] == [LossMonitor, ThroughputMonitor]
    with pytest.raises(ConfigError, match="unknown callback 'nope'"):
        build_callbacks(Config(train=TrainConfig(callbacks=["nope"])))
    # parity is resolved lazily and constructed with the full config
    assert REGISTRY["parity"] == "bert_mp.pretrain.parity_monitor:ParityCallback"
    with pytest.raises(ConfigError, match="parity_reference"):
        build_callbacks(Config(train=TrainConfig(callbacks=["parity"])))


def test_step_flops_counts_mlm_only_where_it_ran():
    cfg = Config()
    f = _facts()
    expected = 6 * 1000 * 400 + 12 * 2 * 4 * (4 * 128**2) + 6 * (16 + 400) * 10 + 6 * (16 + 8) * 4
    assert step_flops(f, _ctx(cfg)) == expected
    cfg.model.sparse_mlm_head = False  # dense head: the decoder runs on every position
    assert step_flops(f, _ctx(cfg)) == expected - 6 * 416 * 10 + 6 * 416 * 512


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak_flops("NVIDIA L40S", "fp16") == 362e12
    assert peak_flops("Intel(R) Xeon(R) Platinum", "bf16") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta


def test_throughput_and_mfu():
    cfg = Config()
    mon = ThroughputMonitor(cfg)
    ctx = _ctx(cfg, num_processes=2)
    mon.on_train_start(None, ctx)
    state, facts = SimpleNamespace(step=1), _facts()
    logs: dict = {}
    mon.on_step_end(state, facts, logs)
    assert logs["throughput/tokens_per_sec"] == 800.0 and logs["throughput/seqs_per_sec"] == 8.0
    assert logs["throughput/positions_per_sec"] == 2 * facts.padded_tokens  # padding included
    assert logs["time/step_ms"] == 500.0 and logs["data/wait_fraction"] == pytest.approx(0.2)
    assert logs["throughput/mfu"] == pytest.approx(step_flops(facts, ctx) / 0.5 / (2 * 989.4e12))
    assert logs["throughput/flops_per_sec"] == pytest.approx(step_flops(facts, ctx) / 0.5)
    cpu = ThroughputMonitor(cfg)
    cpu.on_train_start(None, _ctx(cfg, device_name="Intel Xeon"))
    logs = {}
    cpu.on_step_end(state, facts, logs)
    assert logs["throughput/mfu"] is None
    summary: dict = {}
    for _ in range(30):
        cpu.on_step_end(state, facts, {})
    cpu.on_train_end(state, summary)
    assert summary["throughput"]["tokens_per_sec"] == pytest.approx(800.0)
    assert summary["throughput"]["mfu"] is None and summary["throughput"]["warmup_steps_excluded"] > 0


def test_loss_memory_and_scale_monitors():
    cfg = Config()
    state, facts = SimpleNamespace(step=1, skipped_steps=2), _facts()
    logs: dict = {}
    LossMonitor(cfg).on_step_end(state, facts, logs)
    assert logs["loss/mlm"] == 3.0 and logs["loss/nsp"] == 0.5 and logs["loss/total"] == 3.5
    assert logs["accuracy/mlm"] == 0.5 and logs["accuracy/nsp"] == 0.75
    assert logs["optim/lr"] == 1e-3 and logs["optim/grad_norm"] == 0.5

    mem = MemoryMonitor(cfg)
    mem.on_train_start(state, _ctx(cfg))
    mem.on_step_end(state, facts, logs)
    assert logs["memory/peak_bytes"] > 10 * 2**20  # a Python process with torch loaded

    quiet = LossScaleMonitor(cfg)
    quiet.on_train_start(state, _ctx(cfg))
    out: dict = {}
    quiet.on_step_end(state, facts, out)
    assert out == {}
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    mon = LossScaleMonitor(cfg)
    mon.on_train_start(state, _ctx(cfg, scaler=scaler))
    mon.on_step_end(state, facts, out)
    assert out == {"amp/loss_scale": 256.0, "amp/skipped_steps": 2}


def test_resumed_run_reports_throughput_and_parity_of_the_whole_run(tmp_path, monkeypatch):
    """Callback state is checkpointed: stopped at step 4 and resumed, the throughput and parity
    figures count all 8 steps, and parity equals the uninterrupted run's exactly."""
    from accelerate.state import AcceleratorState, GradientState
    from support import make_prepared, tiny_config

    from bert_mp.core.loop.callbacks import BaseCallback
    from bert_mp.pretrain import monitors
    from bert_mp.pretrain.trainer import train

    class StopAt4(BaseCallback):
        def on_step_end(self, state, facts, logs):
            if state.step == 4 and not getattr(self, "resumed", False):
                state.stop_reason = "test stop at 4"

        def state_dict(self):
            return {"resumed": True}

        def load_state_dict(self, d):
            self.resumed = d["resumed"]

    monkeypatch.setitem(monitors.REGISTRY, "stop_at_4", StopAt4)
    data = make_prepared(tmp_path / "data")

    def run(name, resume=None, stop=False, **kw):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        names = ["throughput", "loss", "memory", "loss_scale", "parity"] + (["stop_at_4"] if stop else [])
        cfg = tiny_config(tmp_path / name, max_steps=8, export=False, callbacks=names, resume=resume, **kw)
        cfg.sweep.parity_window = 3
        return train(cfg, data)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    train(tiny_config(tmp_path / "ref_seed", max_steps=8, export=False, seed=7), data)
    ref = tmp_path / "ref_seed" / "metrics.jsonl"
    whole = run("whole", parity_reference=str(ref))
    stopped = run("split", stop=True, parity_reference=str(ref))
    assert stopped["status"] == "stopped" and stopped["throughput"]["steps_measured"] == 4 - 2
    resumed = run("split", resume="latest", stop=True, parity_reference=str(ref))
    assert resumed["status"] == "completed" and resumed["steps"] == 8
    assert resumed["throughput"]["steps_measured"] == whole["throughput"]["steps_measured"] == 8 - 2
    assert resumed["parity"]["steps_compared"] == 8
    assert resumed["parity"] == whole["parity"]
    assert resumed["memory"]["peak_bytes"] >= stopped["memory"]["peak_bytes"]
