"""The speed levers as config switches: each keeps the numerics, the state-dict and the export.

- ``train.layernorm_precision=autocast``: LayerNorm outputs in bf16 (a 16-bit residual stream), the same
  parameters and keys, losses within bf16's tolerance of autocast's fp32 LayerNorm;
- ``train.compile`` + ``train.compile_mode``: the padded step compiles with zero graph breaks (reported
  in summary.json) and the losses of the eager run;
- ``model.attention_kernel``: a named SDPA kernel gives the losses of torch's own choice; kernels this
  device lacks, and impossible combinations, are refused before any work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import make_prepared, tiny_config
from transformers import BertForPreTraining
from transformers.models.bert.modeling_bert import BertLayer

from bert_mp.core.config import Config, ModelConfig, TrainConfig
from bert_mp.core.numerics.autocast_norms import AutocastLayerNorm
from bert_mp.core.numerics.precision import resolve_precision
from bert_mp.core.storage.files import read_jsonl
from bert_mp.errors import ConfigError, HardwareError
from bert_mp.model.attention import attention_backends, resolve_attention_kernel
from bert_mp.model.bert import bert_config
from bert_mp.pretrain.trainer import train

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared"))


def _losses(out) -> list[float]:
    return [r["loss/total"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]


def _tiny_bert() -> BertForPreTraining:
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", hidden_size=32, num_attention_heads=2, intermediate_size=64)
    return BertForPreTraining(bert_config(cfg, vocab_size=64)).eval()


def _layer_output_dtypes(model: BertForPreTraining, ids: torch.Tensor) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_hook(
            lambda _m, _i, out: seen.add(out[0].dtype if isinstance(out, tuple) else out.dtype)
        )
        for m in model.modules()
        if isinstance(m, BertLayer)
    ]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


def test_autocast_layernorm_makes_a_16bit_residual_stream_with_the_same_parameters():
    ids = torch.randint(5, 64, (2, 12))
    stock, lever = _tiny_bert(), _tiny_bert()
    keys = list(stock.state_dict())
    plan = resolve_precision("bf16", CPU, allow_emulated=True, layernorm="autocast")
    plan.prepare_model(lever)
    assert list(lever.state_dict()) == keys  # checkpoints and the export are unchanged
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), lever.state_dict().values()))
    assert (
        sum(isinstance(m, AutocastLayerNorm) for m in lever.modules()) == 2 * 2 + 1 + 1
    )  # layers, emb, head
    assert _layer_output_dtypes(stock, ids) == {torch.float32}  # autocast's own LayerNorm: fp32 stream
    assert _layer_output_dtypes(lever, ids) == {torch.bfloat16}
    # outside autocast the swapped module is a plain LayerNorm: same logits as the stock model
    with torch.no_grad():
        assert torch.equal(stock(input_ids=ids).prediction_logits, lever(input_ids=ids).prediction_logits)
    assert plan.describe()["layernorm"] == "autocast"
    assert resolve_precision("bf16", CPU, allow_emulated=True).layernorm == "fp32"  # auto on a CPU


def test_autocast_layernorm_trains_within_bf16_tolerance_of_fp32_norms(data, tmp_path):
    runs = {}
    for name, setting in (("fp32_norms", "auto"), ("bf16_norms", "autocast")):
        cfg = tiny_config(tmp_path / name, precision="bf16", max_steps=6, layernorm_precision=setting)
        summary = train(cfg, data)
        assert summary["precision"]["layernorm"] == ("fp32" if setting == "auto" else "autocast")
        runs[name] = _losses(tmp_path / name)
    a, b = torch.tensor(runs["fp32_norms"]), torch.tensor(runs["bf16_norms"])
    assert len(a) == 6 and torch.isfinite(b).all()
    assert torch.allclose(a, b, rtol=2e-2), (a, b)  # bf16 rounding of the stream, not another model
    assert not torch.equal(a, b)  # the lever did act


def test_layernorm_precision_needs_autocast():
    with pytest.raises(ConfigError, match="train.layernorm_precision"):
        Config(train=TrainConfig(precision="fp32", layernorm_precision="autocast")).validate()
    with pytest.raises(HardwareError, match="layernorm_precision=autocast"):
        resolve_precision("bf16_pure", CPU, allow_emulated=True, layernorm="autocast")
    Config(train=TrainConfig(precision="bf16", layernorm_precision="autocast")).validate()


def test_compile_mode_needs_compile():
    with pytest.raises(ConfigError, match="train.compile_mode"):
        Config(train=TrainConfig(compile_mode="reduce-overhead")).validate()
    with pytest.raises(ConfigError, match="train.compile_mode"):
        Config(train=TrainConfig(compile="model", compile_mode="fast")).validate()


def test_coordinate_descent_is_inductors_options_on_top_of_cuda_graphs():
    """``train.compile_mode=coordinate-descent`` hands inductor options torch knows (an unknown key is
    refused when torch.compile is called, before anything compiles) instead of a torch mode."""
    import torch._inductor as inductor

    from bert_mp.model.bert import INDUCTOR_MODES, compile_model

    opts = INDUCTOR_MODES["coordinate-descent"]
    assert (
        opts.items()
        <= {**inductor.list_mode_options("reduce-overhead"), "coordinate_descent_tuning": True}.items()
    )
    seen: list[dict] = []
    layer = torch.nn.Linear(2, 2)
    layer.compile = lambda **kw: seen.append(kw)  # what Module.compile is given
    compile_model(layer, "model", compile_mode="coordinate-descent")
    compile_model(layer, "model", compile_mode="max-autotune")
    assert seen == [{"dynamic": False, "options": opts}, {"dynamic": False, "mode": "max-autotune"}]
    torch.compile(torch.nn.Linear(2, 2), options=opts)  # the keys are inductor's
    Config(train=TrainConfig(compile="model", compile_mode="coordinate-descent")).validate()


def test_compiled_padded_step_has_no_graph_break_and_the_eager_losses(tmp_path):
    """The whole padded forward + loss (and, through AOTAutograd, its backward) is one compiled region:
    dynamo reports zero graph breaks for the run, in summary.json; the losses are the eager run's. Rows
    of one length: one training and one evaluation graph, not one each per length bucket (those:
    test_compile_buckets.py); 37 kernels to build on a cold inductor cache instead of 58."""
    data = make_prepared(tmp_path / "data", n_train=64, n_val=16, full=True)
    eager = tiny_config(tmp_path / "eager", max_steps=4)
    train(eager, data)
    cfg = tiny_config(tmp_path / "compiled", max_steps=4, compile="model", compile_mode="reduce-overhead")
    summary = train(cfg, data)
    comp = summary["compile"]
    assert comp["graph_breaks"] == 0 and comp["graphs"] == 2, comp  # training, evaluation
    assert comp["compile_mode"] == "reduce-overhead"  # CUDA graphs: no effect on a CPU
    assert summary["model"]["dropout_impl"] == "torch"  # auto under compile: fused, no break
    a, b = torch.tensor(_losses(tmp_path / "eager")), torch.tensor(_losses(tmp_path / "compiled"))
    assert torch.allclose(a, b, rtol=1e-4), (a, b)


def test_a_named_attention_kernel_gives_torchs_own_losses(data, tmp_path):
    base = tiny_config(tmp_path / "auto", max_steps=4)
    train(base, data)
    cfg = tiny_config(tmp_path / "math", max_steps=4)
    cfg.model.attention_kernel = "math"
    cfg.validate()
    summary = train(cfg, data)
    assert summary["model"]["attention_kernel"] == "math"
    a, b = torch.tensor(_losses(tmp_path / "auto")), torch.tensor(_losses(tmp_path / "math"))
    assert torch.allclose(a, b, rtol=1e-4), (a, b)


def test_attention_kernel_refusals_and_auto():
    with pytest.raises(HardwareError, match="CUDA kernel"):
        resolve_attention_kernel("cudnn", CPU)
    with pytest.raises(HardwareError, match="CUDA kernel"):
        resolve_attention_kernel("efficient", CPU)
    assert resolve_attention_kernel("auto", CPU) == "auto"  # torch's own priority off the measured devices
    assert resolve_attention_kernel("math", CPU) == "math"
    with pytest.raises(ConfigError, match="model.attention_kernel"):
        Config(model=ModelConfig(attention_kernel="flash")).validate()  # padded: a mask rules flash out
    with pytest.raises(ConfigError, match="model.attention_kernel"):
        Config(model=ModelConfig(attention_kernel="cudnn", attn_implementation="eager")).validate()
    flash = ModelConfig(attention_kernel="flash", unpad=True, attention_probs_dropout_prob=0.0)
    Config(model=flash).validate()
    with pytest.raises(ConfigError, match="model.attention_kernel"):
        Config(model=flash, train=TrainConfig(compile="model")).validate()


def test_attention_backends_restrict_sdpa():
    q = torch.randn(1, 2, 8, 16)
    with attention_backends("math"):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5)
    with attention_backends("efficient"), pytest.raises(RuntimeError):  # no such kernel on a CPU
        torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_bf16_norms_resume_to_the_bit(tmp_path):
    """A run with the 16-bit residual stream stopped at step 3 and resumed gives the straight run's
    losses and weights exactly (the lever holds no state of its own)."""
    from safetensors.torch import load_file
    from support import run_config

    from bert_mp.core.config import save_config

    root = tmp_path / "data"
    make_prepared(root, n_train=40)
    runs = {}
    for name in ("straight", "parts"):
        cfg = tiny_config(
            tmp_path / name, precision="bf16", layernorm_precision="autocast", max_steps=6, save_every=3
        )
        cfg.model.hidden_dropout_prob = 0.1  # the dropout stream is restored too
        runs[name] = cfg

    def run(cfg, stop_at=None) -> int:
        path = tmp_path / f"{Path(cfg.train.output_dir).name}.yaml"
        save_config(cfg, path)
        return run_config(path, root, stop_at)

    assert run(runs["straight"]) == 0
    assert run(runs["parts"], stop_at=3) == 3
    runs["parts"].train.resume = "latest"
    assert run(runs["parts"]) == 0
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "parts")
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
