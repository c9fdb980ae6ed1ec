"""The host-sync budget of a training step, proven on a CPU (tests/sync_double.py stands in for an
accelerator): no host read and no blocking copy inside the model step or the optimizer step; with
``train.metrics_sync=log`` the only reads are at log, evaluation and checkpoint points. The same
budget is counted with CUDA's sync debug mode in test_gpu.py where a GPU is present."""

from __future__ import annotations

import pytest
import torch
from support import make_prepared, tiny_config
from sync_double import HostSyncRecorder

ALLOWED = {"log point", "evaluation", "checkpoint"}
"""Where ``metrics_sync=log`` may read the device back during training."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared"), n_train=64, n_val=16, max_len=32)


def _train(tmp_path, data, monkeypatch, mode: str, unpad: bool = False, **kw) -> HostSyncRecorder:
    """A real train() of a tiny model with the recorder on and the loop's parts named as phases."""
    import bert_mp.core.loop.skeleton as loop
    import bert_mp.pretrain.trainer as tr
    from bert_mp.data.masking import PretrainingCollator

    rec = HostSyncRecorder()
    monkeypatch.setattr(tr, "forward_backward", rec.wrap(tr.forward_backward, "model step"))
    # the optimizer step is the shared loop skeleton's
    monkeypatch.setattr(loop, "optimizer_step", rec.wrap(loop.optimizer_step, "optimizer step"))
    # The collator is host work (in DataLoader workers on an accelerator; with no workers, inside the
    # loop). Its factories may name the host device, torch.device("cpu"), which the double cannot tell
    # from a CPU run's accelerator: its events get a phase of their own.
    monkeypatch.setattr(PretrainingCollator, "__call__", rec.wrap(PretrainingCollator.__call__, "collate"))
    for name, phase in (
        ("train_step", "loop"),
        ("flush", "log point"),
        ("evaluate", "evaluation"),
        ("save", "checkpoint"),
    ):
        monkeypatch.setattr(tr.Trainer, name, rec.wrap(getattr(tr.Trainer, name), phase))
    train_kw = dict(max_steps=6, log_every=3, eval_every=4, save_every=5, export=False, eval_max_batches=1)
    train_kw.update(kw)
    cfg = tiny_config(tmp_path / mode, **train_kw)
    cfg.train.metrics_sync = mode
    cfg.model.unpad = unpad
    # collate in this process, where the recorder counts it (CUDA defaults to DataLoader workers)
    cfg.train.num_workers = 0
    with rec:
        summary = tr.train(cfg, data)
    assert summary["status"] == "completed" and summary["steps"] == train_kw["max_steps"]
    return rec


def _padded(data) -> bool:
    lengths = {len(ids) for ids in data.dataset["train"]["input_ids"]}
    return len(lengths) > 1  # rows of different lengths: the collator pads


def test_log_mode_reads_only_at_log_eval_and_checkpoint_points(data, tmp_path, monkeypatch):
    assert _padded(data)  # padded batches: the attention-mask path is exercised too
    rec = _train(tmp_path, data, monkeypatch, "log")
    log = rec.report()
    assert rec.calls["model step"] == 6 and rec.calls["optimizer step"] == 6, rec.calls
    for phase in ("model step", "optimizer step", "loop"):
        assert rec.count(phase=phase) == 0, f"host syncs in the {phase}:\n{log}"
    during = [e for e in rec.events if e.phase != "outside"]
    assert {e.phase for e in during} <= ALLOWED, log
    # one read of all pending rows per log point (a flush with nothing pending reads nothing)
    assert 1 <= rec.count("read", "log point") <= rec.calls["log point"], log


def test_step_mode_reads_once_before_the_optimizer_step(data, tmp_path, monkeypatch):
    rec = _train(tmp_path, data, monkeypatch, "step", eval_every=0, save_every=0)
    log = rec.report()
    for phase in ("model step", "optimizer step"):
        assert rec.count(phase=phase) == 0, f"host syncs in the {phase}:\n{log}"
    # the step's totals, read before the optimizer step so a non-finite loss stops it
    assert rec.count("read", "loop") == 6 and rec.count("copy", "loop") == 0, log
    assert rec.count("read", "log point") == 6, log


def test_recorder_catches_a_reintroduced_sync(data, tmp_path, monkeypatch):
    """The double is only worth its budget if it fails on the syncs this budget removed."""
    import bert_mp.model.bert as bert
    import bert_mp.pretrain.step as step

    # a 2-D mask again: transformers asks padding_mask.all() every padded forward
    monkeypatch.setattr(bert, "sdpa_padding_mask", lambda mask, impl: mask)
    # figures copied from the host again (torch.as_tensor(..., device=))
    monkeypatch.setattr(step, "device_scalar", lambda v, d: torch.as_tensor(v, dtype=torch.float32, device=d))
    rec = _train(tmp_path, data, monkeypatch, "log", max_steps=2, eval_every=0, save_every=0)
    assert rec.count("read", "model step") >= 2, rec.report()  # the mask check, each forward
    assert rec.count("copy", "model step") >= 2 * 3, rec.report()  # tokens, padded, attention figures


def test_unpadded_model_step_reads_nothing_with_the_collated_layout(data, tmp_path, monkeypatch):
    """model.unpad: the collator brings the unpadded layout with each batch (``unpad_*`` tensors, moved
    to the device with the rest), so the unpadded forward reads no sequence length or count back."""
    rec = _train(tmp_path, data, monkeypatch, "log", unpad=True)
    log = rec.report()
    assert rec.calls["model step"] == 6 and rec.calls["collate"] >= 6, rec.calls
    for phase in ("model step", "optimizer step", "loop"):
        assert rec.count(phase=phase) == 0, f"host syncs in the {phase}:\n{log}"


def test_recorder_catches_the_device_computed_unpadded_layout(data, tmp_path, monkeypatch):
    """Without the collator's layout the model computes it and reads the lengths back, every forward."""
    import bert_mp.model.unpad as unpad

    monkeypatch.setattr(unpad, "collate_layout", lambda wrapper: None)
    rec = _train(tmp_path, data, monkeypatch, "log", unpad=True, max_steps=2, eval_every=0, save_every=0)
    # the longest sequence, read twice each forward (nonzero and unique_consecutive, whose output sizes
    # depend on the data, wait for the device too on CUDA; the double does not see those)
    assert rec.count("read", "model step") >= 2 * 2, rec.report()


def test_recorder_basics():
    p = torch.nn.Parameter(torch.ones(3))
    host = torch.arange(4)
    with HostSyncRecorder() as rec:
        loss = (p * 2).sum().detach()  # read as the loop reads its losses: detached
        int((host > 1).sum())  # a host tensor: free
        torch.full((), 3.0, device=torch.device("cpu"))  # a fill on the device: free
        host.to(torch.device("cpu"), non_blocking=True)  # an asynchronous copy: free
        with rec.phase("x"):
            float(loss)
            if (p > 0).all():
                pass
            torch.tensor(1.0, device=torch.device("cpu"))
            host.to(torch.device("cpu"))
            loss.cpu().item()  # one read: the host copy is a host tensor
    assert [(e.kind, e.phase) for e in rec.events] == [("read", "x")] * 2 + [("copy", "x")] * 2 + [
        ("read", "x")
    ]


class _TwoRanks:
    """Just enough of an Accelerator for forward_backward as rank 0 of 2 (the reduce is the identity)."""

    device = torch.device("cpu")
    num_processes = 2
    distributed_type = "MULTI_CPU"
    gradient_state = type("GS", (), {"_set_sync_gradients": lambda self, v: None})()

    def reduce(self, t, reduction="sum"):
        return t

    def no_sync(self, model):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss, **kw):
        loss.backward()


def test_several_ranks_use_the_reduced_masked_count_without_a_host_read():
    """With several ranks the step's masked-token count is all-reduced and stays a device tensor."""
    from transformers import BertForPreTraining

    from bert_mp.core.config import ModelConfig
    from bert_mp.core.numerics.precision import resolve_precision
    from bert_mp.model.bert import PretrainingModel, bert_config
    from bert_mp.pretrain.step import SUM_KEYS, forward_backward
    from bert_mp.sweep.diagnostics import synthetic_batch

    torch.manual_seed(0)
    model = PretrainingModel(
        BertForPreTraining(bert_config(ModelConfig(preset="tiny"), 300)), max_predictions_per_seq=20
    )
    micro = [synthetic_batch(300, 4, 16, torch.device("cpu"), seed=i) for i in range(2)]
    plan = resolve_precision("fp32", torch.device("cpu"))
    with HostSyncRecorder() as rec:
        figures = forward_backward(model, micro, _TwoRanks(), plan, per_rank=8)
    assert rec.events == [], rec.report()
    assert set(figures) == {*SUM_KEYS, "tokens", "padded_tokens", "attention_flops_tokens", "sequences"}
    assert all(f.shape == () and f.dtype == torch.float32 for f in figures.values())
    assert float(figures["padded_tokens"]) == 2 * 4 * 16
