"""CUDA behaviour (``pytest -m gpu``; skipped without a CUDA device): precision flags, fp16 overflow,
kernel verdicts, export, host syncs per step. Tiny models, a few steps each. Deterministic resume
in fresh processes: integration/test_gpu_resume.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from support import make_prepared
from support import tiny_gpu_config as _gpu_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared"), n_train=256, n_val=32, max_len=32)


def _rows(out: Path) -> list[dict]:
    from bert_mp.core.storage.files import read_jsonl

    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_one_step_per_precision_records_the_flags(data, tmp_path, precision):
    from bert_mp.pretrain.trainer import train

    s = train(_gpu_config(tmp_path / precision, precision=precision, max_steps=2, export=False), data)
    assert s["status"] == "completed" and s["steps"] == 2
    p = s["precision"]
    assert p["device"].startswith("cuda") and p["name"] == precision
    tf32_on = precision == "tf32"
    assert p["matmul"]["cuda_matmul_allow_tf32"] is tf32_on
    assert p["matmul"]["cudnn_allow_tf32"] is tf32_on
    assert p["matmul"]["float32_matmul_precision"] == ("high" if tf32_on else "highest")
    assert p["autocast_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}.get(precision)
    assert p["accelerate_mixed_precision"] == {"bf16": "bf16", "fp16": "fp16"}.get(precision, "no")
    assert p["loss_scaler"] is (precision == "fp16")
    assert (
        s["memory"]["kind"] == "cuda_max_allocated"
        and s["memory"]["peak_reserved_bytes"] >= s["memory"]["peak_bytes"]
    )
    rows = _rows(tmp_path / precision)
    assert all(r["loss/total"] is not None for r in rows)


def test_fp16_overflow_skips_step_without_advancing_scheduler(data, tmp_path, monkeypatch):
    import bert_mp.pretrain.trainer as train_mod
    from bert_mp.core.numerics.optimizers import lr_lambda

    snapshots: list[torch.Tensor] = []
    real = train_mod.build_model

    def build(*a, **k):
        model = real(*a, **k)
        w = model.bert.encoder.layer[0].output.dense.weight

        def hook(grad):
            snapshots.append(w.detach().clone())
            return torch.full_like(grad, float("inf")) if len(snapshots) == 3 else grad

        w.register_hook(hook)
        return model

    cfg = _gpu_config(
        tmp_path / "run",
        precision="fp16",
        max_steps=5,
        fp16_init_scale=1024.0,
        fp16_growth_interval=1000,
        export=False,
    )
    s = train_mod.train(cfg, data, build_model=build)
    rows = _rows(tmp_path / "run")
    assert len(snapshots) == 6 and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert torch.equal(snapshots[2], snapshots[3])  # the overflowed step left the weights alone
    assert [r["amp/loss_scale"] for r in rows] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    f = lr_lambda(cfg.train)
    assert [r["optim/lr"] for r in rows] == pytest.approx([cfg.train.learning_rate * f(i) for i in range(5)])
    assert s["amp"] == {"loss_scale": 512.0, "skipped_steps": 1}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_kernel_check_verdicts(precision):
    from transformers import BertForPreTraining

    from bert_mp.core.config import ModelConfig
    from bert_mp.core.numerics.precision import resolve_precision
    from bert_mp.model.bert import PretrainingModel, bert_config
    from bert_mp.sweep.diagnostics import probe_precision, synthetic_batch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", hidden_size=128, num_attention_heads=2, intermediate_size=512)
    model = PretrainingModel(BertForPreTraining(bert_config(cfg, 512)), max_predictions_per_seq=20).to(dev)
    r = probe_precision(model, synthetic_batch(512, 16, 64, dev), resolve_precision(precision, dev), steps=1)
    check = r["cuda_kernel_check"]
    assert r["batch_padding_fraction"] > 0  # profiled with padding, like training
    g = check["counts"]["gemm"]
    assert g["total"] > 0, r["cuda_kernels"]
    if precision == "fp32":
        assert g["tensor-core"] == 0, r["cuda_kernels"]  # strict fp32: no TF32 GEMM
    else:
        assert g["tensor-core"] > 0 and check["ok"] is True, r["cuda_kernels"]


def test_export_round_trip_reproduces_logits(data, tmp_path, monkeypatch):
    from transformers import BertForPreTraining, BertForSequenceClassification

    import bert_mp.pretrain.trainer as train_mod

    built: list = []
    real = train_mod.build_model
    out = tmp_path / "run"
    train_mod.train(
        _gpu_config(out, precision="bf16", max_steps=3, export=True),
        data,
        build_model=lambda *a, **k: built.append(real(*a, **k)) or built[-1],
    )
    trained = built[-1].eval()
    exported = BertForPreTraining.from_pretrained(str(out / "final")).cuda().eval()
    ids = torch.randint(5, 64, (2, 16), device="cuda")
    with torch.no_grad():
        a = trained(input_ids=ids).prediction_logits.float()
        b = exported(input_ids=ids).prediction_logits.float()
    torch.testing.assert_close(a, b)
    cls = BertForSequenceClassification.from_pretrained(str(out / "final"), num_labels=2).cuda().eval()
    with torch.no_grad():
        torch.testing.assert_close(
            cls.bert(input_ids=ids).last_hidden_state, exported.bert(input_ids=ids).last_hidden_state
        )


def _sync_warnings(caught) -> int:
    """Warnings that report a synchronising CUDA call, not torch's one-time notice that the sync debug
    mode is a prototype (its text also contains "synchroniz")."""
    texts = [str(w.message).lower() for w in caught]
    return sum("synchronizing" in t and "prototype" not in t for t in texts)


def _count_syncs(fn) -> int:
    """CUDA synchronisations ``fn`` triggers, counted with torch's sync debug mode (one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return _sync_warnings(caught)


def _assert_no_syncs_in_bf16_steps(model, opt, batch) -> None:
    """A bf16 forward, backward, clipping and fused AdamW step syncs nowhere (after one warm-up step)."""

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
            loss = (
                out["mlm_loss_sum"] / out["mlm_count"].clamp(min=1) + out["nsp_loss_sum"] / out["nsp_count"]
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: lazy initialisation may sync once
    assert _count_syncs(step) == 0


def test_sync_count_ignores_the_prototype_notice():
    class W:
        def __init__(self, text):
            self.message = text

    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    real = "called a synchronizing CUDA operation"
    assert _sync_warnings([W(notice)]) == 0 and _sync_warnings([W(notice), W(real), W(real)]) == 2
    assert _count_syncs(lambda: torch.ones(2, device="cuda").sum().item()) == 1


@pytest.mark.parametrize("padded", [False, True])
def test_model_step_has_no_host_syncs(padded):
    """Forward, backward, clipping and a fused AdamW step of the pretraining model: no host sync with
    the static masked-row gather, no attention mask for an unpadded batch and a 4-D SDPA mask (so
    transformers does not ask ``mask.all()``) for a padded one."""
    from transformers import BertForPreTraining

    from bert_mp.core.config import ModelConfig
    from bert_mp.model.bert import PretrainingModel, bert_config, drop_full_attention_mask
    from bert_mp.sweep.diagnostics import synthetic_batch

    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", hidden_size=64, num_attention_heads=2, intermediate_size=128)
    model = PretrainingModel(BertForPreTraining(bert_config(cfg, 256)), max_predictions_per_seq=20).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = drop_full_attention_mask(synthetic_batch(256, 8, 32, torch.device("cpu"), padded=padded))
    assert ("attention_mask" in batch) is padded
    batch = {k: v.cuda() for k, v in batch.items()}

    _assert_no_syncs_in_bf16_steps(model, opt, batch)


@pytest.mark.parametrize("attention_dropout", [0.0, 0.1], ids=["flash route", "block route"])
def test_unpadded_model_step_with_the_collated_layout_has_no_host_syncs(attention_dropout):
    """model.unpad with the layout computed on the host, as the trainer's collator adds it
    (``host_layout``): forward, backward, clipping and a fused AdamW step make no host sync, with torch's
    varlen flash kernel (bf16, no attention dropout) and over attention blocks (dropout on)."""
    from transformers import BertForPreTraining

    from bert_mp.core.config import ModelConfig
    from bert_mp.model.bert import PretrainingModel, bert_config
    from bert_mp.model.unpad import host_layout
    from bert_mp.sweep.diagnostics import synthetic_batch

    torch.manual_seed(0)
    cfg = ModelConfig(
        preset="tiny",
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=128,
        attention_probs_dropout_prob=attention_dropout,
    )
    inner = BertForPreTraining(bert_config(cfg, 256))
    model = PretrainingModel(inner, max_predictions_per_seq=20, unpad=True).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    host = synthetic_batch(256, 8, 32, torch.device("cpu"), padded=True)
    host = {**host, **host_layout(host)}
    batch = {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in host.items()}

    _assert_no_syncs_in_bf16_steps(model, opt, batch)


def test_training_loop_host_syncs_are_counted(data, tmp_path, monkeypatch):
    """The loop's syncs per step (between the start of step 1 and the end of the last step; the final
    evaluation and checkpoint copy tensors to the host by design), per ``train.metrics_sync`` mode,
    bounded so a regression shows."""
    from bert_mp.core.loop import callbacks
    from bert_mp.pretrain import monitors
    from bert_mp.pretrain.trainer import train

    n_steps = 6

    class SyncWindow(callbacks.BaseCallback):
        def on_train_start(self, state, ctx):
            super().on_train_start(state, ctx)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")

        def on_step_end(self, state, facts, logs):
            if state.step == n_steps:
                torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setitem(monitors.REGISTRY, "sync_window", SyncWindow)
    train(_gpu_config(tmp_path / "warm", precision="bf16", max_steps=2, export=False), data)
    per_mode = {}
    for mode in ("step", "log"):
        cfg = _gpu_config(tmp_path / mode, precision="bf16", max_steps=n_steps, export=False, log_every=1000)
        cfg.train.callbacks = [*cfg.train.callbacks, "sync_window"]
        cfg.train.metrics_sync = mode
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                train(cfg, data)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        per_mode[mode] = _sync_warnings(caught)
    print(f"host syncs in {n_steps} bf16 steps: {per_mode} (docs/gpu.md, train.metrics_sync)")
    # step: two reads per step (the figures before the optimizer step, the pending row after it);
    # log: the one read of all pending rows at the end (the window closes inside it), nothing per step
    assert per_mode["step"] <= 2 * n_steps
    assert per_mode["log"] <= 1


def test_unpadded_flash_varlen_matches_the_block_path(monkeypatch):
    """On CUDA in bf16 with no attention dropout the unpadded encoder takes torch's varlen flash kernel;
    its losses and gradients agree with the block path (SDPA over per-sequence blocks) to bf16 rounding."""
    pytest.importorskip("torch.nn.attention.varlen")
    import copy

    from transformers import BertConfig, BertForPreTraining

    import bert_mp.model.unpad as unpad_mod
    from bert_mp.model.bert import PretrainingModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    base = BertForPreTraining(cfg).cuda()
    base.set_attn_implementation("sdpa")
    lengths, length = [64, 9, 40, 17, 3, 64], 64
    ids = torch.randint(5, 128, (len(lengths), length), device="cuda")
    mask = (torch.arange(length, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]).long()
    labels = torch.where((torch.rand(ids.shape, device="cuda") < 0.2) & (mask == 1), ids, -100)
    batch = {
        "input_ids": ids * mask,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": mask,
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (len(lengths),), device="cuda"),
    }

    def step(wrapper):
        wrapper.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = wrapper(**batch)
        (out["mlm_loss_sum"] + out["nsp_loss_sum"]).float().backward()
        return out, {n: p.grad.float().clone() for n, p in wrapper.named_parameters() if p.grad is not None}

    used = []
    real_kernel = unpad_mod.flash_varlen_kernel

    def counting(query, dropout, base_name):
        k = real_kernel(query, dropout, base_name)
        used.append(k is not None)
        return k

    monkeypatch.setattr(unpad_mod, "flash_varlen_kernel", counting)
    flash_out, flash_grads = step(PretrainingModel(copy.deepcopy(base), unpad=True))
    assert used and all(used), "the flash kernel was not chosen"
    monkeypatch.setattr(unpad_mod, "flash_varlen_kernel", lambda *a: None)
    block_out, block_grads = step(PretrainingModel(copy.deepcopy(base), unpad=True))
    for k in ("mlm_loss_sum", "nsp_loss_sum"):
        torch.testing.assert_close(flash_out[k].float(), block_out[k].float(), rtol=2e-2, atol=2e-2)
    for name, g in block_grads.items():  # bf16 rounding differs per kernel: compare relative norms
        rel = float((flash_grads[name] - g).norm() / g.norm().clamp_min(1e-6))
        assert rel < 3e-2, (name, rel)


@pytest.mark.parametrize("name", ["adamw", "stable_adamw", "lion"])
def test_optimi_runs_its_triton_update_and_it_matches_its_for_loop(name, monkeypatch):
    """bf16_pure with Kahan summation: torch-optimi's Triton kernel (asked for by name: its own default
    takes the for-loop for nn.Parameters) gives the for-loop's weights, to a bf16 rounding."""
    import copy

    import bert_mp.core.numerics.optimizers as optimizers
    from bert_mp.core.config import TrainConfig

    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    cfg = TrainConfig(optimizer=name, precision="bf16_pure", bf16_update="kahan", learning_rate=1e-3)
    cfg.validate()
    torch.manual_seed(0)
    fast = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8))
    fast = fast.to(cuda, torch.bfloat16)
    loop = copy.deepcopy(fast)
    opt_fast = optimizers.build_optimizer(fast, cfg, cuda)
    monkeypatch.setattr(
        optimizers, "optimi_kernel", lambda device, foreach: {"triton": False, "foreach": False}
    )
    opt_loop = optimizers.build_optimizer(loop, cfg, cuda)
    assert optimizers.describe_optimizer(opt_fast)["kernel"] == "triton"
    assert optimizers.describe_optimizer(opt_loop)["kernel"] == "for-loop"
    g = torch.Generator(device=cuda).manual_seed(1)
    for _ in range(5):
        for a, b in zip(fast.parameters(), loop.parameters()):
            a.grad = torch.randn(a.shape, generator=g, device=cuda).to(torch.bfloat16)
            b.grad = a.grad.clone()
        opt_fast.step()
        opt_loop.step()
    for a, b in zip(fast.parameters(), loop.parameters()):
        assert opt_fast.state[a]["kahan_comp"].shape == a.shape  # a real compensation buffer
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-5)


def test_token_budget_rows_take_the_varlen_kernel_with_empty_sequences_and_match_the_mask(monkeypatch):
    """data.token_budget rows on CUDA in bf16 without attention dropout: torch's varlen kernel on the
    flattened rows, with the batch's fixed-size cu_seqlens (padded tails and empty sequences included),
    gives the block-diagonal mask's losses and gradients to bf16 rounding."""
    pytest.importorskip("torch.nn.attention.varlen")
    import copy

    from support import make_tokenizer, tiny_unpadded_model

    import bert_mp.model.rows as rows_mod
    from bert_mp.core.config import DataConfig
    from bert_mp.data.masking import PretrainingCollator
    from bert_mp.model.bert import PretrainingModel

    tok = make_tokenizer()
    feats = []
    for i, k in enumerate([30, 9, 17, 6, 32, 12, 5]):  # 4 rows of 32: two rows hold two examples
        body = [5 + (3 * i + j) % 59 for j in range(k - 3)]
        ids = [
            tok.cls_token_id,
            *body[: (k - 3) // 2],
            tok.sep_token_id,
            *body[(k - 3) // 2 :],
            tok.sep_token_id,
        ]
        types = [0] * ((k - 3) // 2 + 2) + [1] * (k - (k - 3) // 2 - 2)
        feats.append(
            {"input_ids": ids, "token_type_ids": types, "next_sentence_label": i % 2, "index": i, "epoch": 0}
        )
    collate = PretrainingCollator(
        tok, DataConfig(max_seq_length=32, token_budget=True), seed=1, budget_rows=5
    )
    batch = {k: v.cuda() for k, v in collate(feats).items()}
    assert int(batch["cu_seqlens"][-1]) == 5 * 32 and len(set(batch["cu_seqlens"].tolist())) < len(
        batch["cu_seqlens"]
    )
    base = tiny_unpadded_model(32).model.cuda()
    base.set_attn_implementation("sdpa")

    def step(route_kernel):
        monkeypatch.setattr(rows_mod, "varlen_kernel", route_kernel)
        wrapper = PretrainingModel(copy.deepcopy(base), token_budget=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = wrapper(**batch)
        (out["mlm_loss_sum"] + out["nsp_loss_sum"]).float().backward()
        return out, {n: p.grad.float() for n, p in wrapper.named_parameters() if p.grad is not None}

    used = []
    real = rows_mod.flash_varlen_kernel
    varlen_out, varlen_grads = step(lambda *a: used.append(real(*a)) or used[-1])
    assert used and all(k is not None for k in used), "the varlen kernel was not taken"
    mask_out, mask_grads = step(lambda *a: None)
    for k in ("mlm_loss_sum", "nsp_loss_sum"):
        torch.testing.assert_close(varlen_out[k].float(), mask_out[k].float(), rtol=2e-2, atol=2e-2)
    for name, g in mask_grads.items():
        assert float((varlen_grads[name] - g).norm() / g.norm().clamp_min(1e-6)) < 3e-2, name
