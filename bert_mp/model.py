"""``BertForPreTraining`` from size presets, checks against the data, and the masked-only MLM loss.

The model is always the plain transformers class, so checkpoints keep their state-dict keys and
load with ``from_pretrained``. :class:`PretrainingModel` wraps it only to compute the loss: it runs
the model's own encoder, gathers the rows that carry an MLM label and applies the model's own
``cls.predictions`` head to those rows alone (about 15% of positions), instead of a vocab-sized
matmul over every token. Wrapping (not subclassing) keeps the HF class intact and lets DDP / FSDP
see one module whose ``forward`` does all the work.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForPreTraining

from bert_mp.config import ModelConfig
from bert_mp.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """Encoder shape of one size preset."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 2, 2, 512),
    "mini": Preset(256, 4, 4, 1024),
    "small": Preset(512, 4, 8, 2048),
    "medium": Preset(512, 8, 8, 2048),
    "base": Preset(768, 12, 12, 3072),
    "large": Preset(1024, 24, 16, 4096),
}

_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def bert_config(model_cfg: ModelConfig, vocab_size: int, pad_token_id: int = 0) -> BertConfig:
    """The ``BertConfig`` of a preset with the non-None fields of ``model_cfg`` on top."""
    shape = asdict(PRESETS[model_cfg.preset])
    for name in _SHAPE_FIELDS:
        value = getattr(model_cfg, name)
        if value is not None:
            shape[name] = value
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise ConfigError(
            f"model.hidden_size={shape['hidden_size']} must be divisible by "
            f"model.num_attention_heads={shape['num_attention_heads']}"
        )
    return BertConfig(
        vocab_size=int(model_cfg.vocab_size or vocab_size),
        max_position_embeddings=model_cfg.max_position_embeddings,
        hidden_dropout_prob=model_cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=model_cfg.attention_probs_dropout_prob,
        pad_token_id=pad_token_id,
        **shape,
    )


def check_against_data(config: BertConfig, tokenizer_size: int, max_seq_length: int) -> None:
    """Fail before step 1 when the data cannot fit the model; warn about slow vocabulary sizes."""
    if tokenizer_size > config.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.vocab_size} is smaller than the tokenizer ({tokenizer_size} tokens): "
            "token ids would index past the embedding table. Leave model.vocab_size unset (it then "
            "follows the prepared data) or raise it."
        )
    if max_seq_length > config.max_position_embeddings:
        raise ConfigError(
            f"data.max_seq_length={max_seq_length} exceeds model.max_position_embeddings="
            f"{config.max_position_embeddings}; lower the sequence length or raise the position table"
        )
    if config.vocab_size % 8:
        warnings.warn(
            f"model vocab_size={config.vocab_size} is not a multiple of 8: the embedding and MLM "
            "decoder matmuls miss tensor-core friendly shapes (round it up, e.g. to a multiple of 64)",
            stacklevel=2,
        )


def build_model(
    model_cfg: ModelConfig, vocab_size: int, tokenizer_size: int, max_seq_length: int, pad_token_id: int = 0
) -> BertForPreTraining:
    """A randomly initialised (seed torch first) or ``init_from`` model, checked against the data.

    ``vocab_size`` is the prepared data's ``model_vocab_size``; ``model.vocab_size`` overrides it.
    """
    if model_cfg.init_from:
        model = _load_pretrained(model_cfg)
    else:
        model = BertForPreTraining(bert_config(model_cfg, vocab_size, pad_token_id))
        model.set_attn_implementation(model_cfg.attn_implementation)
    check_against_data(model.config, tokenizer_size, max_seq_length)
    return model


def _load_pretrained(model_cfg: ModelConfig) -> BertForPreTraining:
    source = model_cfg.init_from
    overridden = [n for n in (*_SHAPE_FIELDS, "vocab_size") if getattr(model_cfg, n) is not None]
    if overridden:
        warnings.warn(
            f"model.init_from={source} fixes the architecture; ignoring model.{', model.'.join(overridden)}",
            stacklevel=3,
        )
    if Path(str(source)).exists() and not (Path(str(source)) / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={source}: no config.json there (expected a save_pretrained folder)"
        )
    try:
        return BertForPreTraining.from_pretrained(source, attn_implementation=model_cfg.attn_implementation)
    except OSError as e:
        raise ConfigError(f"model.init_from={source}: cannot load it ({str(e).splitlines()[0]})") from None


def parameter_counts(model: BertForPreTraining) -> dict[str, int]:
    """Parameter counts, including the matmul weights that drive FLOPs (embeddings and norms excluded)."""
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for p in model.bert.embeddings.parameters())
    encoder_matmul = sum(m.weight.numel() for m in model.bert.encoder.modules() if isinstance(m, nn.Linear))
    pooler = model.bert.pooler.dense.weight.numel() if model.bert.pooler is not None else 0
    preds = model.cls.predictions
    return {
        "total": total,
        "embedding": emb,
        "non_embedding": total - emb,
        "encoder_matmul": encoder_matmul,
        "pooler_matmul": pooler,
        "mlm_transform_matmul": preds.transform.dense.weight.numel(),
        "mlm_decoder_matmul": preds.decoder.weight.numel(),
        "nsp_matmul": model.cls.seq_relationship.weight.numel(),
    }


class PretrainingModel(nn.Module):
    """``BertForPreTraining`` plus a loss that reports sums, so a step can normalise them globally.

    ``forward`` returns fp32 scalars: ``mlm_loss_sum`` (cross-entropy summed over masked tokens),
    ``mlm_correct``, ``mlm_count``, ``nsp_loss_sum``, ``nsp_correct``, ``nsp_count``.

    Without ``next_sentence_label`` (data prepared with ``objective=mlm``) no NSP loss is computed:
    ``nsp_count`` is 0 and ``nsp_loss_sum`` is ``0 * logits.sum()``, which keeps the NSP head and the
    pooler in the graph with zero gradients, so DDP sees every parameter used in every step.
    """

    def __init__(self, model: BertForPreTraining, sparse_mlm_head: bool = True):
        super().__init__()
        self.model = model
        self.sparse_mlm_head = sparse_mlm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        next_sentence_label: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        out = self.model.bert(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=True
        )
        seq, pooled = out.last_hidden_state, out.pooler_output
        flat_labels = labels.reshape(-1)
        heads = self.model.cls
        if self.sparse_mlm_head:
            rows = (flat_labels != -100).nonzero().squeeze(1)
            targets = flat_labels.index_select(0, rows)
            hidden = seq.reshape(-1, seq.shape[-1]).index_select(0, rows)
            # losses and the vocab softmax in fp32 whatever the autocast dtype
            logits = heads.predictions(hidden).float()
        else:
            targets = flat_labels
            logits = heads.predictions(seq).float().reshape(-1, self.model.config.vocab_size)
        mlm_loss_sum = F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100)
        valid = targets != -100
        mlm_correct = ((logits.argmax(-1) == targets) & valid).sum()
        nsp_logits = heads.seq_relationship(pooled).float()
        if next_sentence_label is None:
            zero = nsp_logits.sum() * 0.0
            return {
                "mlm_loss_sum": mlm_loss_sum,
                "mlm_correct": mlm_correct.float(),
                "mlm_count": valid.sum().float(),
                "nsp_loss_sum": zero,
                "nsp_correct": zero.detach(),
                "nsp_count": zero.detach(),
            }
        nsp_loss_sum = F.cross_entropy(nsp_logits, next_sentence_label, reduction="sum")
        return {
            "mlm_loss_sum": mlm_loss_sum,
            "mlm_correct": mlm_correct.float(),
            "mlm_count": valid.sum().float(),
            "nsp_loss_sum": nsp_loss_sum,
            "nsp_correct": (nsp_logits.argmax(-1) == next_sentence_label).sum().float(),
            "nsp_count": torch.tensor(float(next_sentence_label.numel()), device=nsp_logits.device),
        }
