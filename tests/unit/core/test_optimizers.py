"""train.optimizer: each optimizer from its library, BERT's no-decay groups, bf16 storage, fp16 skips,
Sophia's Hessian estimate on unscaled gradients."""

from __future__ import annotations

import json

import pytest
import torch
from support import inf_grad_builder, load_fixture, tiny_config

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.config import OPTIMIZERS, TrainConfig
from bert_mp.core.numerics.bf16_updates import COMP_KEY, install_bf16_update, stochastic_round_bf16
from bert_mp.core.numerics.hessian import HessianEstimator
from bert_mp.core.numerics.optimizers import build_optimizer, describe_optimizer, optimi_kernel
from bert_mp.core.numerics.sophia import Sophia
from bert_mp.core.storage.files import read_jsonl

LIBRARY = {
    "adamw": "torch.optim",
    "lamb": "pytorch_optimizer",
    "sophia": "bert_mp.core.numerics.sophia",  # pytorch-optimizer's SophiaH, fed by the loop
    "stable_adamw": "optimi",
    "lion": "optimi",
}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(16, 16)
        self.LayerNorm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.LayerNorm(self.dense(x))))


def _cfg(optimizer: str, precision: str = "fp32", **kw) -> TrainConfig:
    cfg = TrainConfig(optimizer=optimizer, precision=precision, learning_rate=1e-2, weight_decay=0.1, **kw)
    cfg.validate()
    return cfg


def _loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g)
    dtype = next(model.parameters()).dtype
    return model(x.to(dtype)).float().pow(2).mean()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_comes_from_its_library_with_the_no_decay_groups(name):
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, _cfg(name), torch.device("cpu"))
    assert type(opt).__module__.startswith(LIBRARY[name])
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {"dense.weight", "out.weight"}
    assert {names[id(p)] for p in no_decay["params"]} == {
        "dense.bias",
        "LayerNorm.weight",
        "LayerNorm.bias",
        "out.bias",
    }
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model).backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("update", ["kahan", "stochastic", "none"])
def test_bf16_pure_keeps_weights_and_states_in_bf16(name, update):
    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    opt = build_optimizer(model, _cfg(name, "bf16_pure", bf16_update=update), torch.device("cpu"))
    for _ in range(2):
        _loss(model).backward()
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        moments = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape]
        assert moments and all(v.dtype == torch.bfloat16 for v in moments)
        compensated = any(k in opt.state[p] for k in (COMP_KEY, "kahan_comp")) and all(
            opt.state[p].get(k) is not None for k in (COMP_KEY, "kahan_comp") if k in opt.state[p]
        )
        assert compensated == (update == "kahan")


def _gpu_with_triton(monkeypatch):
    import optimi.optimizer
    import optimi.utils

    monkeypatch.setattr(optimi.utils, "HAS_TRITON", True)
    monkeypatch.setattr(optimi.optimizer, "HAS_TRITON", True)  # its constructor's check
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_optimi_runs_its_triton_kernel_on_a_gpu_and_its_cpu_path_elsewhere(monkeypatch):
    # optimi's own default would take the per-tensor for-loop for a model's nn.Parameters
    assert optimi_kernel(torch.device("cpu"), foreach=True) == {"triton": False, "foreach": True}
    _gpu_with_triton(monkeypatch)
    assert optimi_kernel(torch.device("cuda"), foreach=True) == {"triton": True, "foreach": False}
    for name, precision, update in [("adamw", "bf16_pure", "kahan"), ("stable_adamw", "fp32", "kahan")]:
        model = Tiny().to(torch.bfloat16 if precision == "bf16_pure" else torch.float32)
        opt = build_optimizer(model, _cfg(name, precision, bf16_update=update), torch.device("cuda"))
        assert describe_optimizer(opt)["kernel"] == "triton"  # built only: no GPU steps it here


@pytest.mark.parametrize(
    ("name", "precision", "want"),
    [
        ("adamw", "fp32", {"class": "AdamW", "library": "torch", "kernel": "for-loop"}),
        (
            "adamw",
            "bf16_pure",
            {"class": "AdamW", "library": "optimi", "kernel": "for-loop", "kahan_sum": True},
        ),
        ("stable_adamw", "fp32", {"class": "StableAdamW", "library": "optimi", "kernel": "foreach"}),
        (
            "lamb",
            "fp32",
            {"class": "Lamb", "library": "pytorch_optimizer", "kernel": "foreach where the tensors allow"},
        ),
    ],
)
def test_the_update_kernel_is_described_through_a_wrapper(name, precision, want):
    class Wrapper:  # Accelerate's and DeepSpeed's wrappers hold the optimizer that updates
        def __init__(self, optimizer):
            self.optimizer = optimizer

    model = Tiny().to(torch.bfloat16 if precision == "bf16_pure" else torch.float32)
    opt = build_optimizer(model, _cfg(name, precision, fused_adamw=False), torch.device("cpu"))
    got = describe_optimizer(Wrapper(Wrapper(opt)))
    assert {k: got.get(k) for k in want} == want
    if name == "adamw" and precision == "fp32":
        fused = build_optimizer(model, _cfg(name, precision), torch.device("cpu"))
        assert describe_optimizer(fused)["kernel"] == (
            "fused" if fused.param_groups[0]["fused"] else "for-loop"
        )


def test_kahan_and_stochastic_updates_survive_below_bf16_spacing_and_nearest_rounding_stalls():
    """Updates of 1e-3 of a weight of 1.0 (bf16 spacing there: 2**-7 = 0.0078) vanish with nearest
    rounding; Kahan and stochastic rounding accumulate them."""
    moved, efficiency = {}, {}
    for update in ("none", "kahan", "stochastic"):
        p = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
        cfg = _cfg("lamb", "bf16_pure", bf16_update=update)
        opt = torch.optim.SGD([p], lr=1e-3)
        hooks = install_bf16_update(opt, update, cfg.seed)
        for _ in range(100):
            p.grad = torch.ones_like(p)
            opt.step()
        moved[update] = float(1.0 - p.detach().float().mean())
        efficiency[update] = float(hooks.efficiency)
    assert moved["none"] == 0.0 and efficiency["none"] == 0.0
    assert efficiency["kahan"] == pytest.approx(1.0, abs=1e-3)
    assert moved["kahan"] == pytest.approx(0.1, abs=0.01)
    assert moved["stochastic"] == pytest.approx(0.1, abs=0.01)


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = torch.full((20000,), 1.0 + 2**-9)  # a quarter of the way from 1.0 to the next bf16 (1 + 2**-7)
    a = stochastic_round_bf16(x, torch.Generator().manual_seed(1))
    b = stochastic_round_bf16(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert set(a.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float((a.float() > 1.0).float().mean()) == pytest.approx(0.25, abs=0.02)


def _sophia_setup():
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, _cfg("sophia", sophia_update_period=1), torch.device("cpu"))
    return model, opt, HessianEstimator.for_optimizer(opt, _cfg("sophia"))


def test_sophia_hessian_is_estimated_on_the_unscaled_loss():
    model, opt, est = _sophia_setup()
    assert isinstance(opt, Sophia) and est is not None
    assert est.estimate(model, lambda: _loss(model), step=3)
    plain = [h.clone() for h in opt.pending_hessian]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    assert est.estimate(model, lambda: _loss(model), step=3, scaler=scaler)
    for a, b in zip(plain, opt.pending_hessian):  # a power-of-two scale divides out exactly
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)
    assert any(float(h.abs().sum()) > 0 for h in plain)


def test_sophia_drops_an_overflowing_estimate_and_keeps_its_average():
    model, opt, est = _sophia_setup()
    _loss(model).backward()
    assert est.estimate(model, lambda: _loss(model), step=0)
    opt.step()
    average = [opt.state[p]["hessian_moment"].clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    assert not est.estimate(model, lambda: _loss(model), step=1, scaler=scaler)
    assert opt.pending_hessian is None and est.dropped == 1
    _loss(model).backward()
    opt.step()  # no fresh estimate: the moving average is unchanged
    for a, p in zip(average, model.parameters()):
        assert torch.equal(a, opt.state[p]["hessian_moment"])
        assert "hessian" not in opt.state[p]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fp16_inf_gradients_skip_the_step_for_every_optimizer(tmp_path, prepared, name):
    # the 4th backward pass that touches the watched weight gives inf (Sophia's estimate at step 0 is one)
    build = inf_grad_builder(lambda n: n == 4)
    run = tmp_path / "run"
    cfg = tiny_config(run, precision="fp16", optimizer=name, max_steps=5, fp16_growth_interval=1000)
    cfg.train.sophia_update_period = 1000
    train_mod.train(cfg, load_fixture(prepared), build_model=build)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 5 and summary["skipped_steps"] == 1
    scales = [r["amp/loss_scale"] for r in read_jsonl(run / "metrics.jsonl") if "amp/loss_scale" in r]
    assert scales[-1] == cfg.train.fp16_init_scale / 2


def test_sophia_with_a_compiled_model_is_refused_naming_the_key():
    from bert_mp.errors import ConfigError

    with pytest.raises(ConfigError, match="train.compile"):
        TrainConfig(optimizer="sophia", compile="model").validate()


def test_the_loops_import_without_the_optimizer_libraries():
    """A GPU machine gets only the wheels it is carried: train and finetune with AdamW must not need
    pytorch-optimizer or torch-optimi (a None entry in sys.modules makes their import fail)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytorch_optimizer'] = None; sys.modules['optimi'] = None; "
        "import bert_mp.pretrain.trainer, bert_mp.finetune.trainer, bert_mp.core.numerics.optimizers"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
