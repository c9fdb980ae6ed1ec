"""fp8 training through torchao's float8 Linears: which layers convert, and the conversion itself.

The rule (:func:`fp8_eligible`): an ``nn.Linear`` converts when both its dimensions are divisible by
16 (float8 matmul kernels need that) and it is not an output head - the MLM decoder
(``cls.predictions.decoder``) and the NSP head (``cls.seq_relationship``) stay at the master
precision unless ``fp8_convert_heads`` asks for them, because the loss reads their logits directly.
``Float8Linear`` subclasses ``nn.Linear`` and keeps its ``weight`` / ``bias``, so state-dict keys
and checkpoints stay plain Hugging Face weights. Where the device has no float8 matmuls, torchao's
``emulate=True`` runs the same scaling and casts with fp32 matmuls: numerics, not speed.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from bert_mp.errors import HardwareError

HEAD_NAMES = ("cls.predictions.decoder", "cls.seq_relationship", "classifier")
"""Output heads kept out of float8 unless asked for (pretraining's MLM decoder and NSP head, a
fine-tuned classifier)."""


def check_torchao(key: str = "train.precision") -> None:
    """torchao's float8 training must import; otherwise say how to get it."""
    import logging

    import torch

    log = logging.getLogger("torchao")
    level = log.level
    if not torch.cuda.is_available():  # its CUDA kernel libraries cannot load here, and are not needed
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # an ImportError, or a torchao built for another torch
        raise HardwareError(
            f"{key}=fp8 needs torchao's float8 training (pip install torchao); importing it failed: {e}"
        ) from e
    finally:
        log.setLevel(level)


def fp8_eligible(name: str, module: nn.Module, heads: bool = False) -> bool:
    """Whether the Linear ``module`` at ``name`` converts to float8 (see the module docstring)."""
    if not isinstance(module, nn.Linear):
        return False
    if module.in_features % 16 or module.out_features % 16:
        return False
    return heads or not name.endswith(HEAD_NAMES)


def convert_fp8(model: nn.Module, recipe: str, emulate: bool, heads: bool = False) -> list[str]:
    """Swap the eligible Linears of ``model`` for torchao ``Float8Linear`` in place; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate)
    converted = [n for n, m in model.named_modules() if fp8_eligible(n, m, heads)]
    convert_to_float8_training(
        model, module_filter_fn=lambda m, fqn: fp8_eligible(fqn, m, heads), config=config
    )
    return converted
