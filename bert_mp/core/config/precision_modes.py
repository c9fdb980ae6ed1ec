"""The precision modes and their options by name, without importing torch.

Config loading checks values against these before any command imports torch (``bert-mp config``,
a config mistake reported by ``bert-mp train``); :mod:`bert_mp.core.numerics.precision` gives them meaning.
"""

AMP_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""The modes with fp32 weights and autocast (the default sweep)."""
PRECISIONS = (*AMP_PRECISIONS, "bf16_pure", "fp8")
BF16_UPDATES = ("kahan", "stochastic", "none")
FP8_RECIPES = ("tensorwise", "rowwise")
