"""train.py: accumulation equivalence, fp16 overflow handling, non-finite stops, metrics and trackers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file
from support import inf_grad_builder, make_prepared, nan_forward_builder, tiny_config

from bert_mp.core.numerics.optimizers import lr_lambda
from bert_mp.core.storage.files import read_jsonl
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
    "throughput/positions_per_sec",
    "throughput/seqs_per_sec",
    "throughput/flops_per_sec",
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


def test_the_stopped_line_says_how_to_continue_the_run():
    from bert_mp.core.loop.state import outcome_line

    stopped = {"status": "stopped", "steps": 7, "stop_reason": "signal SIGINT"}
    assert outcome_line("train", stopped, "runs/a") == (
        "bert-mp train: stopped after 7 steps (signal SIGINT; checkpoint saved) -> runs/a; "
        "continue it with the same command and train.resume=latest"
    )
    assert outcome_line("finetune", stopped, "runs/f").endswith("and finetune.resume=latest")
    done = {"status": "completed", "steps": 9, "stop_reason": None}
    assert outcome_line("train", done, "runs/a", "final eval MLM loss 6.5") == (
        "bert-mp train: completed after 9 steps (final eval MLM loss 6.5) -> runs/a"
    )


# --------------------------------------------------------------------------------------------------
# train.metrics_sync=log: step metrics read back at log points (the CUDA default), same figures
# --------------------------------------------------------------------------------------------------
TIMING_KEYS = {k for k in TRAIN_KEYS if k.startswith(("time/", "throughput/"))}
TIMING_KEYS |= {"data/wait_fraction", "memory/peak_bytes"}


def _without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_metrics_read_at_log_points_match_every_step(data, tmp_path, precision):
    """Same losses, learning rates, grad norms, token counts, eval and weights whether the host reads
    the step metrics every step or every log_every steps (which need not divide max_steps or save_every)."""
    out = {}
    for mode in ("step", "log"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        out[mode] = tmp_path / mode
        kw = dict(
            precision=precision, max_steps=7, log_every=3, eval_every=5, save_every=4, metrics_sync=mode
        )
        summary = train(tiny_config(out[mode], **kw), data)
        assert summary["status"] == "completed" and summary["steps"] == 7
        out[mode] = (out[mode], summary)
    (a, sa), (b, sb) = out["step"], out["log"]
    rows_a, rows_b = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in _metrics(b)] == list(range(1, 8))
    assert _without_timing(rows_a) == _without_timing(rows_b)
    assert sa["tokens_seen"] == sb["tokens_seen"] > 0
    assert sa["throughput"]["steps_measured"] == sb["throughput"]["steps_measured"]
    wa = load_file(a / "final" / "model.safetensors")
    wb = load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_metrics_sync_auto_reads_every_step_off_cuda():
    from bert_mp.pretrain.trainer import syncs_each_step

    assert syncs_each_step("auto", torch.device("cpu")) is True
    assert syncs_each_step("auto", torch.device("cuda")) is False
    assert syncs_each_step("log", torch.device("cpu")) is False
    assert syncs_each_step("step", torch.device("cuda")) is True


def test_nonfinite_loss_read_late_stops_naming_the_last_good_checkpoint(data, tmp_path):
    """With metrics_sync=log a NaN at step 5 is seen at the step-6 read; the checkpoint of step 4 is the
    last good state and nothing is saved after the NaN."""
    run = tmp_path / "run"
    cfg = tiny_config(run, max_steps=9, log_every=3, save_every=4, metrics_sync="log")
    with pytest.raises(TrainingError) as err:
        train(cfg, data, build_model=nan_forward_builder(lambda n: n == 5))
    msg = str(err.value)
    assert "non-finite loss (nan) at step 5 in fp32, read back at step 6" in msg
    assert msg.endswith("train.metrics_sync=step stops at the step itself with the state before it saved.")
    assert str(run / "checkpoints" / "step_00000004") in msg
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]  # the steps read before the NaN
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "failed" and "read back at step 6" in s["error"]


@pytest.mark.signals  # a SIGTERM sent to this process from inside the step: ordered by construction
def test_signal_stops_the_same_step_when_metrics_are_read_late(data, tmp_path):
    """One process: a SIGTERM seen during step 2 stops after step 2 in both modes, all rows written."""
    stopped = {}
    for mode in ("step", "log"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        run = tmp_path / mode
        build = nan_forward_builder(lambda n: False)

        def signalling(*a, _build=build, **k):
            model = _build(*a, **k)
            calls = []

            def hook(module, inputs, output):
                calls.append(1)
                if len(calls) == 2 and module.training:
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGTERM)
                return output

            model.bert.embeddings.register_forward_hook(hook)
            return model

        s = train(tiny_config(run, max_steps=6, log_every=4, metrics_sync=mode), data, build_model=signalling)
        stopped[mode] = (s["status"], s["stop_reason"], s["steps"], [r["step"] for r in _metrics(run)])
        assert (run / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert stopped["step"] == stopped["log"] == ("stopped", "signal SIGTERM", 2, [1, 2])
