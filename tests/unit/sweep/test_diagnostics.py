import torch
from transformers import BertForPreTraining

from bert_mp.core.config import ModelConfig
from bert_mp.core.numerics.precision import cpu_capabilities, resolve_precision
from bert_mp.model.bert import PretrainingModel, bert_config
from bert_mp.sweep.diagnostics import (
    bytes_per_parameter,
    classify_cuda_kernel,
    dimension_flags,
    kernel_verdict,
    loss_scale_health,
    parse_onednn_verbose,
    probe_precision,
    speed_ladder,
    synthetic_batch,
)

CPU = torch.device("cpu")


def _summary(tps, ms, mfu=None):
    return {"throughput": {"tokens_per_sec": tps, "step_ms": ms, "mfu": mfu}}


def test_speed_ladder_ratios_against_fp32():
    runs = [
        {"name": "fp32", "precision": "fp32", "summary": _summary(1000.0, 50.0)},
        {"name": "bf16", "precision": "bf16", "summary": _summary(2500.0, 20.0, 0.31)},
        {"name": "fp16", "precision": "fp16", "summary": None},
    ]
    rows = {r["name"]: r for r in speed_ladder(runs)}
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0
    assert rows["bf16"]["speedup_vs_fp32"] == 2.5 and rows["bf16"]["mfu"] == 0.31
    assert rows["fp16"]["speedup_vs_fp32"] is None and rows["fp16"]["tokens_per_sec"] is None


def test_loss_scale_health_counts_drops_and_skips():
    rows = [
        {"step": 1, "kind": "train", "amp/loss_scale": 65536.0, "amp/skipped_steps": 0},
        {"step": 2, "kind": "train", "amp/loss_scale": 32768.0, "amp/skipped_steps": 1},
        {"step": 3, "kind": "train", "amp/loss_scale": 16384.0, "amp/skipped_steps": 2},
        {"step": 3, "kind": "eval", "eval/loss_mlm": 1.0},
        {"step": 4, "kind": "train", "amp/loss_scale": 32768.0, "amp/skipped_steps": 2},
    ]
    h = loss_scale_health(rows)
    assert h["scale_drops"] == 2 and h["skipped_steps"] == 2
    assert h["min_scale"] == 16384.0 and h["final_scale"] == 32768.0
    assert loss_scale_health([{"step": 1, "kind": "train", "loss/mlm": 1.0}]) is None


def test_mixed_precision_keeps_parameter_state():
    fp32, bf16 = bytes_per_parameter("fp32"), bytes_per_parameter("bf16")
    assert fp32["total"] == bf16["total"] == 16.0
    assert bf16["weights"] + bf16["gradients"] + bf16["optimizer_state"] == fp32["total"]


def test_cuda_kernel_classification():
    assert classify_cuda_kernel("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize") == "tensor-core"
    assert classify_cuda_kernel("cutlass_80_tensorop_s16816gemm_bf16_128x256") == "tensor-core"
    assert classify_cuda_kernel("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_wgmma") == "tensor-core"
    assert classify_cuda_kernel("volta_sgemm_128x64_nn") == "simt"
    assert classify_cuda_kernel("vectorized_elementwise_kernel") is None


ONEDNN_LOG = """\
onednn_verbose,v1,info,oneDNN v3.12.0
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ba::f0 dst:bf16::blocked:ab::f0,attr-scratchpad:user,,64x128:128x512,0.09
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ab::f0 dst:bf16::blocked:ab::f0,attr-scratchpad:user,,64x512:512x128,0.08
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512,undef,src:f16::blocked:ab::f0 wei:f16::blocked:ba::f0 dst:f16::blocked:ab::f0,attr-scratchpad:user,,64x128:128x512,0.15
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:f32::blocked:ab::f0 dst:bf16::blocked:ab::f0,,,64x128,0.01
"""


def test_onednn_verbose_parsing():
    rows = parse_onednn_verbose(ONEDNN_LOG)
    assert [(r["class"], r["count"]) for r in rows] == [("amx", 2), ("avx512-fp16", 1)]
    assert "2/3 oneDNN matmuls on AMX" in kernel_verdict("bf16", "cpu", rows, [])
    assert "not strict" in kernel_verdict("fp32", "cpu", rows, [])
    assert "fp32 BLAS" in kernel_verdict("bf16", "cpu", [], [])


def test_dimension_flags():
    flags = dimension_flags({"hidden_size": 768, "vocab_size": 30522, "micro_batch_size": 12})
    assert flags == ["vocab_size=30522 is not a multiple of 8", "micro_batch_size=12 is not a multiple of 8"]


def _tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", hidden_size=32, num_attention_heads=2, intermediate_size=64)
    return PretrainingModel(BertForPreTraining(bert_config(cfg, 256)))


def test_probe_measures_state_and_activations_fp32():
    model = _tiny_model()
    n = sum(p.numel() for p in model.parameters())
    r = probe_precision(model, synthetic_batch(256, 4, 32, CPU), resolve_precision("fp32", CPU), steps=1)
    per = r["measured_bytes_per_parameter"]
    assert r["parameters"] == n
    assert per["weights"] == 4.0 and per["gradients"] == 4.0 and per["optimizer_state"] == 8.0
    assert r["measured_bytes"]["activations_saved_for_backward"] > 0
    assert any(op["op"] in ("aten::addmm", "aten::mm") for op in r["matmul_ops"])
    assert not [x for x in r["onednn_matmuls"] if x["class"] != "fp32"]


def test_probe_bf16_uses_reduced_precision_matmuls():
    if not cpu_capabilities().bf16:
        import pytest

        pytest.skip("CPU without native bf16 (AVX512-BF16 or AMX): oneDNN runs no bf16 matmul kernels")
    model = _tiny_model()
    r = probe_precision(model, synthetic_batch(256, 4, 32, CPU), resolve_precision("bf16", CPU), steps=1)
    # fp32 master weights: parameter state per parameter is unchanged by autocast
    assert r["measured_bytes_per_parameter"]["weights"] == 4.0
    assert r["onednn_matmuls"] and all(x["src_dtype"] == "bf16" for x in r["onednn_matmuls"])


def _state_bytes(r: dict) -> int:
    return sum(r["measured_bytes"][k] for k in ("weights", "gradients", "optimizer_state"))


def test_bf16_pure_saves_over_a_third_of_bf16_autocasts_parameter_state():
    """Measured by the probe with the run's optimizer: 16 B/param under autocast, 10 with bf16_pure
    (2 weights + 2 gradients + 4 moments + 2 Kahan compensation)."""
    from bert_mp.core.config import TrainConfig

    batch = synthetic_batch(256, 4, 32, CPU)
    amp = probe_precision(
        _tiny_model(),
        batch,
        resolve_precision("bf16", CPU, allow_emulated=True),
        1,
        TrainConfig(precision="bf16"),
    )
    pure = probe_precision(
        _tiny_model(),
        batch,
        resolve_precision("bf16_pure", CPU, allow_emulated=True),
        1,
        TrainConfig(precision="bf16_pure"),
    )
    assert pure["measured_bytes_per_parameter"] == {"weights": 2.0, "gradients": 2.0, "optimizer_state": 6.0}
    assert 1 - _state_bytes(pure) / _state_bytes(amp) >= 0.35
    assert pure["theory_bytes_per_parameter"]["total"] == 10.0
