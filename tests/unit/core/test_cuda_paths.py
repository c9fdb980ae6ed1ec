"""The CUDA-path logic, tested on CPU: kernel-name verdicts, MFU peak table, attention FLOPs, DeepSpeed /
FSDP set-up, attention implementations, dropout refusal, compile, masked-row gather, loader defaults,
device-side step metrics and the benchmark's device placement."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from support import ROOT, load_script, tiny_model_config
from transformers import BertForPreTraining

from bert_mp.core.config import load_config
from bert_mp.core.engine.distributed import (
    accelerate_mixed_precision,
    configure_deepspeed,
    deepspeed_config,
    validate_deepspeed_config,
)
from bert_mp.core.numerics.precision import resolve_precision
from bert_mp.core.numerics.step_scalars import DeviceStepMetrics
from bert_mp.errors import ConfigError, HardwareError
from bert_mp.model.bert import (
    PretrainingModel,
    bert_config,
    check_attn_implementation,
    compile_model,
    drop_full_attention_mask,
)
from bert_mp.model.dropout import resolve_dropout_impl
from bert_mp.pretrain.device_feed import loader_kwargs
from bert_mp.pretrain.monitors import attention_flops_tokens, peak_flops
from bert_mp.sweep.diagnostics import (
    classify_cuda_kernel,
    cuda_kernel_kind,
    cuda_kernel_verdict,
    kernel_verdict,
    synthetic_batch,
)

CPU = torch.device("cpu")

# Kernel names as the CUDA profiler reports them (cuBLAS / cuBLASLt / CUTLASS / SDPA backends).
STRICT_FP32 = [
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel_trt",
    "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4_execute_kernel_trt",
    "cutlass_80_simt_sgemm_128x128_8x4_nn_align1",
    "ampere_sgemm_128x64_tn",
]
SKINNY = [  # cuBLAS's kernels for the NSP head (768->2) and the pooler's backward, in any precision
    "gemmSN_TN_kernel",
    "gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>",
    "gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false>",
]
TF32 = [
    "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x16_stage4_warpsize2x2x1_tensor16x8x8_execute_kernel_trt",
    "cutlass_80_tensorop_s1688gemm_128x128_16x3_nn_align4",
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
]
BF16 = [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT",
    "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_128x128_32x3_nn_align8",
]
FP16 = [
    "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn",
    "volta_h884gemm_128x128_ldg8_nn",
    "turing_h1688gemm_128x128_ldg8_tn",
]
ATTENTION = [
    "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
    "fmha_cutlassB_f32_aligned_128x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, float, true, false, true, 128, 64, 64, false>::Params)",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>, false>",
]
NOT_PRODUCTS = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>",
    "void splitKreduce_kernel<32, 16, int, float, float, float, float, true, false, false>",
]


def _rows(names, count=1, device_us=None):
    return [
        {
            "kernel": n,
            "kind": cuda_kernel_kind(n),
            "class": classify_cuda_kernel(n),
            "count": count,
            **({"device_us": device_us} if device_us is not None else {}),
        }
        for n in names
    ]


def test_strict_fp32_kernels_are_not_tensor_cores():
    for name in STRICT_FP32:
        assert classify_cuda_kernel(name) == "simt", name
    for name in TF32 + BF16 + FP16:
        assert classify_cuda_kernel(name) == "tensor-core", name
    for name in NOT_PRODUCTS:
        assert classify_cuda_kernel(name) is None, name
    for name in SKINNY:
        assert classify_cuda_kernel(name) == "skinny", name


STRICT = {"cuda_matmul_allow_tf32": False, "float32_matmul_precision": "highest"}
TF32_ON = {"cuda_matmul_allow_tf32": True, "float32_matmul_precision": "high"}


def test_verdict_is_weighted_by_device_time():
    # bf16: the big GEMMs on tensor cores, one small fp32 GEMM (1% of the time): ok by time
    rows = _rows(BF16, device_us=3300.0) + _rows(STRICT_FP32[:1], count=40, device_us=100.0)
    v = cuda_kernel_verdict("bf16", rows)
    assert v["ok"] is True and v["weighted_by"] == "device_us" and "99.0% of GEMM device time" in v["gemm"]
    # the same launches with the fp32 GEMM holding half the time: not ok
    rows = _rows(BF16, device_us=1000.0) + _rows(STRICT_FP32[:1], count=40, device_us=3000.0)
    assert cuda_kernel_verdict("bf16", rows)["ok"] is False


def test_skinny_gemms_get_their_own_line_and_do_not_fail_a_mode():
    for prec, names in (("bf16", BF16), ("fp16", FP16), ("tf32", TF32)):
        v = cuda_kernel_verdict(
            prec, _rows(names, device_us=1000.0) + _rows(SKINNY, count=24, device_us=50.0)
        )
        assert v["ok"] is True, v["text"]
        assert v["skinny"].startswith("skinny GEMMs") and "72 launches" in v["skinny"]
        assert "skinny" not in v["gemm"]
    assert cuda_kernel_verdict("bf16", _rows(BF16))["skinny"] is None


def test_opaque_kernels_of_strict_fp32_are_decided_by_the_flags_in_force():
    nvjet = ["nvjet_sss_128x128_64x4_1x2_h_bz_NNT", "nvjet_sss_64x64_128x8_2x1_v_bz_TNN"]
    # TF32 off: no tensor-core path for an fp32 product, whatever the kernel is called
    v = cuda_kernel_verdict("fp32", _rows(nvjet + STRICT_FP32[:1]), flags=STRICT)
    assert v["ok"] is True and "counted as fp32 from the flags" in v["gemm"], v["gemm"]
    assert v["counts"]["gemm"]["tensor-core"] == 0
    # the same names with TF32 on are tensor-core kernels: strict fp32 is violated
    assert cuda_kernel_verdict("fp32", _rows(nvjet), flags=TF32_ON)["ok"] is False
    # a name that states TF32 stays a violation under any flags
    assert cuda_kernel_verdict("fp32", _rows(TF32[:1]), flags=STRICT)["ok"] is False
    # in a 16-bit run nvjet names are tensor-core kernels (the flags only decide strict fp32)
    assert cuda_kernel_verdict("bf16", _rows(nvjet), flags=STRICT)["ok"] is True


def test_attention_kernels_get_their_own_line():
    for name in ATTENTION:
        assert cuda_kernel_kind(name) == "attention", name
    assert all(cuda_kernel_kind(n) == "gemm" for n in STRICT_FP32 + TF32 + BF16)
    # strict fp32 with the 3xTF32 memory-efficient attention: the GEMM verdict stays "ok"
    v = cuda_kernel_verdict("fp32", _rows(STRICT_FP32 + ATTENTION[:2]))
    assert v["ok"] is True and v["counts"]["gemm"]["tensor-core"] == 0
    assert v["counts"]["attention"]["total"] == 2 and "attention: 2" in v["attention"]
    # one TF32 GEMM in a strict fp32 run is a violation
    assert cuda_kernel_verdict("fp32", _rows(STRICT_FP32 + TF32[:1]))["ok"] is False
    for prec, names in (("tf32", TF32), ("bf16", BF16), ("fp16", FP16)):
        assert cuda_kernel_verdict(prec, _rows(names + ATTENTION))["ok"] is True
        assert cuda_kernel_verdict(prec, _rows(names + STRICT_FP32[:1]))["ok"] is False
    assert "NOT strict" in kernel_verdict("fp32", "cuda", [], _rows(BF16))
    assert cuda_kernel_verdict("bf16", [])["ok"] is None


def test_probe_batch_is_padded_like_training():
    b = synthetic_batch(300, 16, 64, CPU, seed=1)
    lengths = b["attention_mask"].sum(1)
    assert int(lengths[0]) == 64 and int(lengths.min()) < 64
    pad = b["attention_mask"] == 0
    assert (b["labels"][pad] == -100).all() and (b["input_ids"][pad] == 0).all()
    assert bool(synthetic_batch(300, 4, 32, CPU, padded=False)["attention_mask"].all())


def test_peak_table_matches_whole_names():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H100 NVL", "bf16") == 835.5e12
    assert peak_flops("NVIDIA H800", "tf32") == 494.7e12
    assert peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H200 NVL", "bf16") == 835.5e12
    assert peak_flops("NVIDIA A800-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("NVIDIA A100 80GB PCIe", "tf32") == 156e12
    assert peak_flops("NVIDIA B200", "bf16") == 2250e12
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("NVIDIA L40", "bf16") == 181e12
    assert peak_flops("NVIDIA L40S", "bf16") == 362e12
    assert peak_flops("NVIDIA A10G", "bf16") == 70e12
    for unknown in ("NVIDIA GeForce RTX 4090", "NVIDIA L4000 Ada", "NVIDIA H100X", "AMD EPYC 7B13", ""):
        assert peak_flops(unknown, "bf16") is None, unknown


def test_attention_flops_use_real_lengths():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert attention_flops_tokens(mask) == 4**2 + 2**2


def test_deepspeed_config_is_explicit_and_valid():
    ds = deepspeed_config(micro_batch_size=32, accumulation=4, world_size=8, max_grad_norm=1.0)
    validate_deepspeed_config(ds)
    assert ds["train_batch_size"] == 32 * 4 * 8 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert "auto" not in json.dumps(ds)
    with pytest.raises(ConfigError, match="auto"):
        validate_deepspeed_config({**ds, "train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ConfigError):
        validate_deepspeed_config({**ds, "train_batch_size": 100})
    # Accelerate accepts it as a plugin config (no deepspeed package needed to build the plugin)
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=ds)
    assert plugin.zero_stage == 2 and plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 32


def test_configure_deepspeed_fills_the_accelerate_yaml_plugin():
    from accelerate.utils import DeepSpeedPlugin

    acc_yaml = yaml.safe_load((ROOT / "configs/accelerate/deepspeed_zero2.yaml").read_text())
    assert acc_yaml["mixed_precision"] == "no"
    dsc = acc_yaml["deepspeed_config"]
    # what `accelerate launch` builds from that YAML: "auto" batch fields
    plugin = DeepSpeedPlugin(zero_stage=dsc["zero_stage"], gradient_clipping=dsc["gradient_clipping"])
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=16, max_grad_norm=0.5))
    ds = configure_deepspeed(accelerator, cfg, accumulation=3)
    assert ds["train_micro_batch_size_per_gpu"] == 16 and ds["train_batch_size"] == 96
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"]["stage"] == 2
    validate_deepspeed_config(ds)
    plan = resolve_precision("fp32", CPU)
    assert accelerate_mixed_precision(plan, "DistributedType.DEEPSPEED") == "no"
    fp16 = SimpleNamespace(use_scaler=True, accelerate_mixed_precision="fp16")
    with pytest.raises(ConfigError, match="DeepSpeed"):
        accelerate_mixed_precision(fp16, "DEEPSPEED")
    with pytest.raises(ConfigError, match=r"^finetune\.precision=fp16 .*use finetune\.precision=bf16"):
        accelerate_mixed_precision(fp16, "DEEPSPEED", "finetune.precision")
    assert accelerate_mixed_precision(fp16, "MULTI_GPU") == "fp16"


def test_fsdp_policy_is_fp32_master_weights():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from bert_mp.core.engine.distributed import configure_fsdp

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what Accelerate does for mixed_precision=bf16
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    configure_fsdp(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    pol = plugin.mixed_precision_policy
    assert pol.param_dtype == torch.float32 and pol.reduce_dtype == torch.float32


def test_attention_implementations(tmp_path):
    assert check_attn_implementation("sdpa") == "sdpa"
    assert check_attn_implementation("eager") == "eager"
    assert check_attn_implementation("flex_attention") == "flex_attention"
    with pytest.raises(ConfigError, match="one BERT supports"):
        check_attn_implementation("paged_attention")
    if importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="flash"):
            check_attn_implementation("flash_attention_2", CPU)
    # flash-attn kernels are 16-bit only: refused with fp32 before any work
    with pytest.raises(ConfigError, match="flash_attention_2"):
        load_config(None, ["model.attn_implementation=flash_attention_2", "train.precision=fp32"])
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        load_config(None, ["model.attn_implementation=xformers"])


def test_fast_dropout_is_refused_on_cuda():
    assert resolve_dropout_impl("auto", torch.device("cuda")) == "torch"
    assert resolve_dropout_impl("auto", CPU) == "fast"
    with pytest.raises(HardwareError, match="CPU speed-up"):
        resolve_dropout_impl("fast", torch.device("cuda"))


def _tiny(**kw):
    torch.manual_seed(0)
    return PretrainingModel(BertForPreTraining(bert_config(tiny_model_config(), 256)), **kw)


def test_static_masked_gather_matches_nonzero():
    batch = synthetic_batch(256, 6, 32, CPU, seed=3)
    per_seq = int((batch["labels"] != -100).sum(1).max())
    dynamic, static = _tiny(), _tiny(max_predictions_per_seq=per_seq + 3)
    a, b = dynamic(**batch), static(**batch)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-5)


def test_full_mask_dropped_only_without_padding():
    full = {"attention_mask": torch.ones(2, 8, dtype=torch.long), "input_ids": torch.zeros(2, 8)}
    assert "attention_mask" not in drop_full_attention_mask(full)
    padded = {"attention_mask": torch.tensor([[1, 1], [1, 0]])}
    assert drop_full_attention_mask(padded) is padded
    model = _tiny()
    batch = synthetic_batch(256, 3, 16, CPU, padded=False)
    a = model(**batch)
    b = model(**drop_full_attention_mask(batch))
    torch.testing.assert_close(a["mlm_loss_sum"], b["mlm_loss_sum"])


def test_compile_option_keeps_keys_and_runs():
    if not hasattr(torch, "compile"):
        pytest.skip("no torch.compile")
    model = _tiny(max_predictions_per_seq=8)
    keys = set(model.state_dict())
    with pytest.raises(ConfigError):
        compile_model(model, "everything")
    assert compile_model(model, "none") is model
    compiled = compile_model(model, "layers")
    assert set(compiled.state_dict()) == keys
    batch = synthetic_batch(256, 2, 16, CPU)
    try:
        out = compiled(**batch)
    except Exception as e:  # no C++ compiler / inductor backend on this machine
        pytest.skip(f"torch.compile unavailable here: {type(e).__name__}: {str(e)[:200]}")
    out["mlm_loss_sum"].backward()
    assert torch.isfinite(out["mlm_loss_sum"])


def test_mark_step_marks_only_where_cuda_graph_trees_can_exist(monkeypatch):
    """An uncompiled process skips the mark (no tree can read it; the trees' import costs 0.5 CPU s);
    compile_model imports the trees, so a compiled model is marked from its first step. (The trees'
    module is stood in for by a harmless stdlib module, so torch's own is never imported twice.)"""
    import sys

    from bert_mp.model import bert

    assert bert._CUDAGRAPH_TREES == "torch._inductor.cudagraph_trees"
    trees = "json.tool"
    marks = []
    monkeypatch.setattr(bert, "_CUDAGRAPH_TREES", trees)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.delitem(sys.modules, trees, raising=False)
    bert.mark_step()
    compile_model(_tiny(), "none")
    bert.mark_step()
    assert marks == [] and trees not in sys.modules
    compile_model(_tiny(), "layers")  # before any forward: nothing is compiled yet
    assert trees in sys.modules
    bert.mark_step()
    assert marks == [1]


def test_loader_defaults_follow_the_device():
    assert loader_kwargs(-1, None, CPU) == {"num_workers": 0, "pin_memory": False}
    cuda = loader_kwargs(-1, None, torch.device("cuda"))
    assert cuda["pin_memory"] is True and cuda["num_workers"] >= 0
    assert loader_kwargs(2, False, torch.device("cuda"))["pin_memory"] is False
    assert loader_kwargs(2, True, CPU)["pin_memory"] is False  # nothing to pin for on CPU


def test_device_step_metrics_flush_at_log_points():
    m = DeviceStepMetrics(keys=("loss", "grad_norm"), log_every=3)
    got = []
    for step in range(1, 8):
        m.record(step, {"loss": torch.tensor(float(step)), "grad_norm": 0.5 * step}, host={"step_ms": 10.0})
        if m.should_flush(step):
            got.append(m.flush())
    assert [len(g) for g in got] == [3, 3] and m.pending == 1
    assert got[1][0] == {"step": 4, "step_ms": 10.0, "loss": 4.0, "grad_norm": 2.0}
    assert m.flush()[0]["step"] == 7 and m.flush() == []
    with pytest.raises(KeyError):
        m.record(8, {"loss": torch.tensor(1.0)})


def test_bench_baseline_follows_the_device_argument():
    bench = load_script("bench/harness")
    data = bench.synthetic_prepared(8, 32, 300, 320)
    args = SimpleNamespace(seq=32, micro_batch=2, warmup=1, steps=1, preset="tiny", vocab=300)
    order = torch.arange(8).numpy()
    model, batches = bench.baseline_setup(data, args, order, torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {v.device.type for b in batches for v in b.values()} == {"meta"}
    r = bench.bench_baseline(data, args, order, CPU)
    assert r["device"] == "cpu" and r["tokens_per_sec"] > 0
