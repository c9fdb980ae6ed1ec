"""precision.py: flags that take effect, hardware checks (mocked), and the CPU fp16 path end to end."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from bert_mp.core.loop.update import unscale_gradients
from bert_mp.core.numerics import precision
from bert_mp.core.numerics.precision import install_scaler, resolve_precision
from bert_mp.errors import HardwareError

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_flags():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_fp32_is_strict_after_tf32():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    plan = resolve_precision("fp32", CPU)
    plan.apply_backend_flags()
    d = plan.describe()
    assert d["matmul"]["cuda_matmul_allow_tf32"] is False
    assert d["matmul"]["cudnn_allow_tf32"] is False
    assert d["matmul"]["float32_matmul_precision"] == "highest"
    assert d["autocast_dtype"] is None and d["loss_scaler"] is False
    assert plan.make_scaler() is None
    assert plan.accelerate_mixed_precision == "no"
    assert {"torch", "transformers", "accelerate", "datasets", "python"} <= set(d["versions"])


@pytest.mark.skipif(
    not precision.cpu_capabilities().bf16,
    reason="CPU without native bf16 (AVX512-BF16 or AMX): no tf32 analogue (tested refused below)",
)
def test_cpu_tf32_is_labelled_onednn_analogue_and_changes_matmul():
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    plan = resolve_precision("tf32", CPU)
    with precision.backend_flags(plan):
        d = plan.describe()
        analogue = a @ b
    strict = a @ b
    assert d["matmul"]["float32_matmul_precision"] == "medium"
    assert d["matmul"]["mkldnn_matmul_fp32_precision"] == "bf16"
    assert "analogue" in d["note"] and d["emulated"] is False
    # the mode took effect: the product differs from strict fp32 (by how much depends on the chip)
    assert not torch.equal(analogue, strict)
    assert torch.allclose(analogue, strict, rtol=0.05, atol=0.5)


def test_cuda_checks_mocked():
    cuda = torch.device("cuda", 0)
    with (
        mock.patch.object(torch.cuda, "get_device_capability", return_value=(7, 0)),
        mock.patch.object(torch.cuda, "get_device_name", return_value="Tesla V100"),
    ):
        for name in ("tf32", "bf16"):
            with pytest.raises(HardwareError, match="compute capability >= 8.0.*V100"):
                resolve_precision(name, cuda)
        plan = resolve_precision("fp16", cuda, init_scale=1024, growth_interval=7)
        assert plan.accelerate_mixed_precision == "fp16"
        # Accelerate owns the CUDA scaler; we only hand it the settings
        assert plan.make_scaler() is None
        (handler,) = plan.accelerate_kwargs_handlers()
        assert handler.init_scale == 1024 and handler.growth_interval == 7
    with (
        mock.patch.object(torch.cuda, "get_device_capability", return_value=(6, 1)),
        mock.patch.object(torch.cuda, "get_device_name", return_value="GTX 1080"),
        pytest.raises(HardwareError, match="fp16"),
    ):
        resolve_precision("fp16", cuda)
    with (
        mock.patch.object(torch.cuda, "get_device_capability", return_value=(8, 0)),
        mock.patch.object(torch.cuda, "get_device_name", return_value="A100"),
    ):
        plan = resolve_precision("tf32", cuda)
        plan.apply_backend_flags()
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "high"
        assert resolve_precision("bf16", cuda).accelerate_mixed_precision == "bf16"


def test_cpu_without_bf16_is_refused_mocked():
    with mock.patch.object(precision, "_cpu_supports_bf16", return_value=False):
        with pytest.raises(HardwareError, match="AVX512-BF16 or AMX"):
            resolve_precision("bf16", CPU)
        with pytest.raises(HardwareError, match="tf32 analogue"):
            resolve_precision("tf32", CPU)
        assert resolve_precision("fp32", CPU).name == "fp32"


@pytest.fixture
def weakest_cpu(monkeypatch):
    """Every reduced-precision feature masked: the probes report an AVX2-only CPU on any machine."""
    monkeypatch.setenv(precision.CPU_MASK_ENV, "all")
    caps = precision.cpu_capabilities()
    assert (caps.bf16, caps.fp16, caps.amx) == (False, False, False)
    assert caps.masked == ("amx", "bf16", "fp16")
    return caps


def test_mask_refuses_reduced_precision_with_the_cost_and_the_opt_in(weakest_cpu):
    for name in ("bf16", "fp16"):
        with pytest.raises(HardwareError) as e:
            resolve_precision(name, CPU, key="finetune.precision")
        msg = str(e.value)
        assert f"finetune.precision={name}" in msg and "masked by BERT_MP_CPU_MASK" in msg
        assert "hardware.allow_emulated=true" in msg and precision.EMULATION_SLOWDOWN in msg
        assert "\n" not in msg
    # no emulation makes a tf32 analogue: oneDNN ignores its bf16 math mode without native bf16
    with pytest.raises(HardwareError, match="nothing to emulate"):
        resolve_precision("tf32", CPU, allow_emulated=True)
    assert resolve_precision("fp32", CPU).emulated is False


def test_opt_in_runs_emulated_precision_with_one_warning_line(weakest_cpu, capsys, monkeypatch):
    monkeypatch.setattr(precision, "_warned_emulated", set())
    plan = resolve_precision("fp16", CPU, allow_emulated=True)
    resolve_precision("fp16", CPU, allow_emulated=True)  # warned once per process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: train.precision=fp16 is emulated" in err
    assert plan.emulated and plan.use_scaler and plan.autocast_dtype == torch.float16
    d = plan.describe()
    assert d["emulated"] is True and "emulated" in d["note"]
    assert d["cpu_capabilities"] == {
        "bf16": False,
        "fp16": False,
        "amx": False,
        "masked": ["amx", "bf16", "fp16"],
    }


def test_mask_names_are_checked_and_cap_onednn(monkeypatch):
    monkeypatch.setenv(precision.CPU_MASK_ENV, "fp16, AMX")
    assert precision.cpu_mask() == {"fp16", "amx"}
    caps = precision.cpu_capabilities()
    assert not caps.fp16 and not caps.amx and caps.bf16 == precision._cpu_supports_bf16()
    assert precision.onednn_isa_cap(frozenset({"fp16", "amx"})) == "AVX512_CORE_BF16"
    assert precision.onednn_isa_cap(frozenset({"amx"})) == "AVX10_1_512"
    assert precision.onednn_isa_cap(frozenset({"bf16"})) == "AVX512_CORE_VNNI"
    assert precision.onednn_isa_cap(frozenset()) is None
    monkeypatch.setenv(precision.CPU_MASK_ENV, "avx512,fp16")
    with pytest.raises(HardwareError, match="unknown feature.*avx512"):
        precision.cpu_capabilities()


def test_an_aten_capability_gets_an_inductor_cache_of_its_own(monkeypatch, tmp_path):
    """Inductor's cache is not keyed by ATEN_CPU_CAPABILITY: a process under it gets its own folder,
    unless the user named another; without it nothing changes."""
    monkeypatch.setattr(precision.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    precision.inductor_cache_of_its_own()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", " AVX2 ")
    precision.inductor_cache_of_its_own()
    folder = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert folder.startswith(str(tmp_path / "torchinductor_")) and folder.endswith("_aten_avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    precision.inductor_cache_of_its_own()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    # inductor's own default, which it writes into the variable when first asked: replaced
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder.removesuffix("_aten_avx2"))
    precision.inductor_cache_of_its_own()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder


def test_native_precision_is_not_marked_emulated(monkeypatch):
    monkeypatch.delenv(precision.CPU_MASK_ENV, raising=False)
    caps = precision.cpu_capabilities()
    for name in ("bf16", "fp16"):
        plan = resolve_precision(name, CPU, allow_emulated=True)
        assert plan.emulated is (not caps.has(name))


def test_cpu_bf16_autocast_dtype():
    plan = resolve_precision("bf16", CPU, allow_emulated=True)
    lin = torch.nn.Linear(8, 8)
    with plan.autocast():
        y = lin(torch.randn(2, 8))
    assert y.dtype == torch.bfloat16
    assert plan.make_scaler() is None and plan.accelerate_mixed_precision == "no"


def test_cpu_fp16_end_to_end_through_accelerate():
    """Autocast fp16 + our CPU GradScaler wired into Accelerate: scale, unscale, skip on inf."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    plan = resolve_precision("fp16", CPU, init_scale=2.0**10, growth_interval=1000, allow_emulated=True)
    acc = Accelerator(cpu=True, mixed_precision=plan.accelerate_mixed_precision)
    scaler = install_scaler(acc, plan)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 2.0**10
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    assert opt.scaler is scaler

    x = torch.randn(8, 16)
    with plan.autocast():
        out = model(x)
    assert out.dtype == torch.float16
    loss = out.float().pow(2).mean()
    acc.backward(loss)
    scaled = model.weight.grad.clone()
    unscale_gradients(acc, opt)
    assert torch.allclose(model.weight.grad * 2.0**10, scaled, rtol=1e-3)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    before = model.weight.detach().clone()
    opt.step()
    opt.zero_grad()
    assert not acc.optimizer_step_was_skipped
    assert not torch.equal(model.weight, before)

    # an inf gradient: step skipped, weights unchanged, scale halved
    with plan.autocast():
        loss = model(x).float().sum()
    acc.backward(loss)
    model.weight.grad[0, 0] = float("inf")
    unscale_gradients(acc, opt)
    before = model.weight.detach().clone()
    opt.step()
    assert acc.optimizer_step_was_skipped
    assert torch.equal(model.weight, before)
    assert scaler.get_scale() == 2.0**9
    assert plan.describe(scaler)["scaler_scale"] == 2.0**9
