"""The ``model`` section: the BertForPreTraining architecture and its kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bert_mp.core.config.checks import _check, _choice, _range

MODEL_PRESETS = ("tiny", "mini", "small", "medium", "base", "large")
ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient", "math")


@dataclass
class ModelConfig:
    """BertForPreTraining architecture: a size preset with any field overridable."""

    preset: str = "tiny"
    """tiny (2x128) | mini (4x256) | small (4x512) | medium (8x512) | base (12x768) | large (24x1024)."""
    hidden_size: Optional[int] = None
    """Override the preset's hidden width (must be divisible by the number of heads)."""
    num_hidden_layers: Optional[int] = None
    """Override the preset's number of encoder layers."""
    num_attention_heads: Optional[int] = None
    """Override the preset's attention heads per layer."""
    intermediate_size: Optional[int] = None
    """Override the preset's feed-forward width."""
    max_position_embeddings: int = 512
    """Size of the position table; data.max_seq_length must not exceed it."""
    hidden_dropout_prob: float = 0.1
    """Dropout on embeddings and sub-layer outputs (BERT: 0.1)."""
    attention_probs_dropout_prob: float = 0.1
    """Dropout on attention probabilities (BERT: 0.1)."""
    vocab_size: Optional[int] = None
    """None: the prepared tokenizer's size rounded up to a multiple of 64."""
    init_from: Optional[str] = None
    """Continue pretraining from this checkpoint folder or Hub name instead of random init."""
    attn_implementation: str = "sdpa"
    """Attention kernel: sdpa (default; torch's fused kernels) | eager (reference) | flash_attention_2
    (flash-attn package, unpadded varlen kernel; CUDA, bf16/fp16) | flex_attention (torch flex attention,
    padded blocks skipped). Unavailable ones are refused before training starts."""
    attention_kernel: str = "auto"
    """Which fused attention kernel SDPA may use: auto (torch's choice; docs/gpu.md has the measured
    ranking) | cudnn | efficient (memory-efficient) | math (the reference, unfused) | flash (torch's
    varlen flash kernel on the unpadded stream or on data.token_budget rows: needs model.unpad=true
    (with train.compile=none) or data.token_budget=true, and no attention dropout; a padded batch's
    mask rules flash out). cudnn and efficient are CUDA kernels."""
    sparse_mlm_head: bool = True
    """Run the MLM decoder only on masked positions (same parameters and state-dict keys)."""
    unpad: bool = False
    """Run the encoder on real tokens only: rows flattened to one token stream, attention within each
    sequence (padding never enters a matmul). Same parameters, checkpoints and export; faster the more
    padding the data has (docs/training.md). Needs attn_implementation sdpa or eager."""
    dropout_impl: str = "auto"
    """Dropout masks: fast (one 64-bit draw per 4 elements, p rounded to 1/32768; see
    bert_mp/model/dropout.py; CPU only) | torch (torch's own) | auto (fast on an uncompiled CPU run; torch's
    on GPUs and under train.compile, where inductor fuses it without a graph break)."""

    def validate(self) -> None:
        _choice(self.preset, "model.preset", MODEL_PRESETS)
        _choice(
            self.attn_implementation,
            "model.attn_implementation",
            ("sdpa", "eager", "flash_attention_2", "flex_attention"),
        )
        _choice(self.dropout_impl, "model.dropout_impl", ("auto", "torch", "fast"))
        _choice(self.attention_kernel, "model.attention_kernel", ATTENTION_KERNELS)
        _check(
            self.attention_kernel == "auto" or self.attn_implementation == "sdpa",
            "model.attention_kernel",
            f"chooses among SDPA's kernels; it needs model.attn_implementation=sdpa (got "
            f"{self.attn_implementation})",
            self.attention_kernel,
        )
        if self.attention_kernel == "flash":
            _check(
                self.attention_probs_dropout_prob == 0,
                "model.attention_kernel",
                "flash runs torch's varlen flash kernel, which has no dropout: add "
                "model.attention_probs_dropout_prob=0, or use auto / cudnn / efficient",
                self.attention_kernel,
            )
        if self.unpad:
            _check(
                self.attn_implementation in ("sdpa", "eager"),
                "model.unpad",
                "the unpadded encoder runs attention through sdpa or eager; set model.attn_implementation=sdpa",
                self.attn_implementation,
            )
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        ):
            v = getattr(self, name)
            if v is not None:
                _range(v, f"model.{name}", 1)
        _range(self.max_position_embeddings, "model.max_position_embeddings", 8)
        _range(self.hidden_dropout_prob, "model.hidden_dropout_prob", 0.0, 1.0)
        _range(self.attention_probs_dropout_prob, "model.attention_probs_dropout_prob", 0.0, 1.0)
