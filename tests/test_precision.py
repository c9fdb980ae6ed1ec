"""precision.py: flags that take effect, hardware checks (mocked), and the CPU fp16 path end to end."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from bert_mp.core import precision
from bert_mp.core.precision import install_scaler, resolve_precision, unscale_gradients
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


@pytest.mark.skipif(not precision._cpu_supports_bf16(), reason="CPU without bf16")
def test_cpu_tf32_is_labelled_onednn_analogue_and_changes_matmul():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    ref = a.double() @ b.double()
    plan = resolve_precision("tf32", CPU)
    with precision.backend_flags(plan):
        d = plan.describe()
        err_analogue = ((a @ b).double() - ref).abs().max().item()
    err_strict = ((a @ b).double() - ref).abs().max().item()
    assert d["matmul"]["float32_matmul_precision"] == "medium"
    assert d["matmul"]["mkldnn_matmul_fp32_precision"] == "bf16"
    assert "analogue" in d["note"]
    # bf16 inner products are visibly less exact than strict fp32
    assert err_analogue > 100 * err_strict


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


def test_cpu_bf16_autocast_dtype():
    plan = resolve_precision("bf16", CPU)
    lin = torch.nn.Linear(8, 8)
    with plan.autocast():
        y = lin(torch.randn(2, 8))
    assert y.dtype == torch.bfloat16
    assert plan.make_scaler() is None and plan.accelerate_mixed_precision == "no"


def test_cpu_fp16_end_to_end_through_accelerate():
    """Autocast fp16 + our CPU GradScaler wired into Accelerate: scale, unscale, skip on inf."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    plan = resolve_precision("fp16", CPU, init_scale=2.0**10, growth_interval=1000)
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
