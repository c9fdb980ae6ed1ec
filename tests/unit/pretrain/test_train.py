"""train.py: accumulation equivalence, fp16 overflow handling, non-finite stops, metrics and trackers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file
from support import inf_grad_builder, make_prepared, nan_forward_builder, tiny_config

from bert_mp.core.io import read_jsonl
from bert_mp.core.optim import lr_lambda
from bert_mp.errors import TrainingError
from bert_mp.pretrain.batches import MicroBatchSampler, epoch_order
from bert_mp.pretrain.trainer import train

TRAIN_KEYS = {
    "step",
    "kind",
    "loss/total",
    "loss/mlm",
    "loss/nsp",
    "accuracy/mlm",
    "accuracy/nsp",
    "optim/lr",
    "optim/grad_norm",
    "time/step_ms",
    "throughput/tokens_per_sec",
    "throughput/seqs_per_sec",
    "throughput/mfu",
    "memory/peak_bytes",
    "data/wait_fraction",
}
EVAL_KEYS = {"eval/loss_mlm", "eval/loss_nsp", "eval/accuracy_mlm", "eval/accuracy_nsp", "eval/perplexity"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared"))


def _metrics(out: Path, kind: str = "train") -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == kind]


def test_sampler_order_is_a_function_of_seed_and_epoch():
    assert (epoch_order(50, 1, 0) == epoch_order(50, 1, 0)).all()
    assert not (epoch_order(50, 1, 0) == epoch_order(50, 1, 1)).all()
    # one process with 2 micro-batches sees exactly what 2 ranks with 1 micro-batch each see
    single = iter(MicroBatchSampler(20, 8, 4, 0, 1, seed=3, epoch=0, batch=0))
    r0 = iter(MicroBatchSampler(20, 8, 4, 0, 2, seed=3, epoch=0, batch=0))
    r1 = iter(MicroBatchSampler(20, 8, 4, 1, 2, seed=3, epoch=0, batch=0))
    for _ in range(3):  # crosses the epoch end (20 // 8 = 2 batches per epoch)
        assert next(single) + next(single) == next(r0) + next(r1)
    # starting at a data position continues the same stream
    full = iter(MicroBatchSampler(20, 8, 8, 0, 1, seed=3, epoch=0, batch=0))
    seq = [next(full) for _ in range(5)]
    resumed = iter(MicroBatchSampler(20, 8, 8, 0, 1, seed=3, epoch=1, batch=1))
    assert [next(resumed) for _ in range(2)] == seq[3:5]
    assert seq[2][0][0] == 1  # third batch is epoch 1


def test_run_writes_contract_outputs_and_learns(data, tmp_path):
    cfg = tiny_config(
        tmp_path / "run",
        max_steps=80,
        eval_every=40,
        learning_rate=1e-2,
        warmup_steps=10,
        global_batch_size=16,
        micro_batch_size=16,
        log_with=["tensorboard"],
    )
    summary = train(cfg, data)
    out = tmp_path / "run"
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 81))
    assert set(rows[0]) >= TRAIN_KEYS
    assert rows[0]["throughput/mfu"] is None  # CPU: no peak in the table
    evals = _metrics(out, "eval")
    assert [e["step"] for e in evals] == [40, 80] and set(evals[0]) >= EVAL_KEYS
    first = sum(r["loss/mlm"] for r in rows[:5]) / 5
    last = sum(r["loss/mlm"] for r in rows[-5:]) / 5
    assert last < first - 0.3, (first, last)
    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(summary, default=str))
    assert s["status"] == "completed" and s["steps"] == 80
    assert s["precision"]["matmul"]["float32_matmul_precision"] == "highest"
    assert s["precision"]["matmul"]["cuda_matmul_allow_tf32"] is False
    assert {"torch", "transformers", "accelerate", "datasets", "python"} <= set(s["versions"])
    assert s["throughput"]["tokens_per_sec"] > 0 and s["memory"]["peak_bytes"] > 0
    assert s["final_eval"]["eval/loss_mlm"] == evals[-1]["eval/loss_mlm"]
    assert s["model"]["parameters"]["total"] > 0 and s["amp"]["skipped_steps"] == 0
    assert (out / "config.yaml").is_file() and (out / "final" / "model.safetensors").is_file()
    # tensorboard through Accelerate's log_with
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = {}
    for events in (out / "trackers").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        logged.update({tag: len(acc.Scalars(tag)) for tag in acc.Tags()["scalars"]})
    assert logged["loss/mlm"] == 80 and logged["eval/loss_mlm"] == 2


def test_accumulation_equals_one_large_batch(data, tmp_path):
    """4 micro-batches of 4 == one batch of 16 (fp32, masked-token normalisation over the whole step)."""
    runs = {}
    for micro in (16, 4):
        out = tmp_path / f"m{micro}"
        cfg = tiny_config(out, max_steps=5, global_batch_size=16, micro_batch_size=micro, export=False)
        summary = train(cfg, data)
        assert summary["batch"]["accumulation"] == 16 // micro
        runs[micro] = (
            [r["loss/total"] for r in _metrics(out)],
            load_file(str(out / "checkpoints" / "step_00000005" / "model.safetensors")),
        )
    (l1, w1), (l4, w4) = runs[16], runs[4]
    assert l1 == pytest.approx(l4, rel=1e-6, abs=1e-6)
    for k in w1:
        torch.testing.assert_close(w1[k], w4[k], rtol=1e-5, atol=1e-6)


def test_fp16_inf_skips_step(data, tmp_path):
    snapshots: list[torch.Tensor] = []
    build = inf_grad_builder(lambda n: n == 3, snapshots)
    cfg = tiny_config(
        tmp_path / "run",
        precision="fp16",
        max_steps=6,
        fp16_init_scale=1024.0,
        fp16_growth_interval=1000,
        export=False,
    )
    summary = train(cfg, data, build_model=build)
    rows = _metrics(tmp_path / "run")
    # 7 backward passes for 6 optimizer steps: the 3rd was skipped
    assert len(snapshots) == 7 and [r["step"] for r in rows] == list(range(1, 7))
    assert not torch.equal(snapshots[1], snapshots[2])  # a normal step changes the weights
    assert torch.equal(snapshots[2], snapshots[3])  # the skipped one does not
    scales = [r["amp/loss_scale"] for r in rows]
    assert scales[:2] == [1024.0, 1024.0] and scales[2:] == [512.0] * 4
    assert [r["amp/skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    # the scheduler did not advance on the skipped step
    f = lr_lambda(cfg.train)
    assert [r["optim/lr"] for r in rows] == pytest.approx([cfg.train.learning_rate * f(i) for i in range(6)])
    assert summary["amp"] == {"loss_scale": 512.0, "skipped_steps": 1}
    assert summary["precision"]["autocast_dtype"] == "float16" and summary["precision"]["loss_scaler"] is True


def test_fp16_consecutive_skips_stop_with_checkpoint(data, tmp_path):
    cfg = tiny_config(tmp_path / "run", precision="fp16", max_steps=6, max_consecutive_skipped_steps=3)
    with pytest.raises(TrainingError, match="3 optimizer steps in a row overflowed"):
        train(cfg, data, build_model=inf_grad_builder(None))
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "failed" and s["skipped_steps"] == 3 and s["steps"] == 0
    assert (tmp_path / "run" / "checkpoints" / "step_00000000" / "COMPLETE").is_file()


def test_nonfinite_loss_in_fp32_stops(data, tmp_path):
    cfg = tiny_config(tmp_path / "run", max_steps=6)
    with pytest.raises(TrainingError, match="non-finite loss .* step 3 in fp32"):
        train(cfg, data, build_model=nan_forward_builder(lambda n: n == 3))
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_record_what_took_effect(data, tmp_path, precision):
    summary = train(tiny_config(tmp_path / "run", precision=precision, max_steps=3, export=False), data)
    assert summary["status"] == "completed"
    p = summary["precision"]
    assert p["autocast_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert p["loss_scaler"] is (precision == "fp16")
    assert p["accelerate_mixed_precision"] == "no"  # CPU: our own autocast and scaler, not Accelerate's


def test_dataloader_workers_do_not_change_the_run(data, tmp_path):
    """Masking and order come from (seed, epoch, index), not from the process that collates."""
    losses = {}
    for workers in (0, 1):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        out = tmp_path / f"w{workers}"
        train(tiny_config(out, max_steps=3, num_workers=workers, export=False), data)
        losses[workers] = [r["loss/total"] for r in _metrics(out)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_only_a_completed_run_exits_zero():
    from bert_mp.pretrain.trainer import exit_code

    assert exit_code({"status": "completed", "stop_reason": None}) == 0
    assert exit_code({"status": "stopped", "stop_reason": "signal SIGTERM"}) == 143
    assert exit_code({"status": "stopped", "stop_reason": "signal SIGINT"}) == 130
    assert exit_code({"status": "stopped", "stop_reason": "parity: left the band"}) == 3
