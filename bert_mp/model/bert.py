"""``BertForPreTraining`` from size presets, checks against the data, and the masked-only MLM loss.

The model is always the plain transformers class, so checkpoints keep their state-dict keys and
load with ``from_pretrained``. :class:`PretrainingModel` wraps it only to compute the loss: it runs
the model's own encoder, gathers the rows that carry an MLM label and applies the model's own
``cls.predictions`` head to those rows alone (about 15% of positions), instead of a vocab-sized
matmul over every token. Wrapping (not subclassing) keeps the HF class intact and lets DDP / FSDP
see one module whose ``forward`` does all the work.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForPreTraining

from bert_mp.core.config import ModelConfig
from bert_mp.errors import ConfigError
from bert_mp.model.attention import attention_backends
from bert_mp.model.buckets import masked_per_row
from bert_mp.model.sources import check_init_from


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
        model.set_attn_implementation(check_attn_implementation(model_cfg.attn_implementation))
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
    found = check_init_from(model_cfg)
    try:
        return BertForPreTraining.from_pretrained(
            found, attn_implementation=check_attn_implementation(model_cfg.attn_implementation)
        )
    except OSError as e:
        raise ConfigError(f"model.init_from={source}: cannot load it ({str(e).splitlines()[0]})") from None


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flex_attention")
"""What transformers' BERT accepts as ``attn_implementation`` (and bert_mp offers)."""


def check_attn_implementation(name: str, device: torch.device | str | None = None) -> str:
    """Return ``name`` if this machine can run it, else raise HardwareError saying what to use.

    - ``sdpa``: torch's fused attention (flash / memory-efficient / cuDNN kernels on CUDA). A padded
      batch needs a mask, which rules out the flash kernel; memory-efficient attention takes it.
    - ``eager``: explicit matmul + softmax (the reference; slowest).
    - ``flash_attention_2``: the ``flash-attn`` package; transformers unpads padded batches and
      calls its varlen kernel, so padding costs nothing. CUDA only, fp16/bf16 only.
    - ``flex_attention``: torch's compiled flex attention with a block mask built from padding
      (padded blocks are skipped). Needs a torch with ``torch.nn.attention.flex_attention``.
    """
    from bert_mp.errors import HardwareError

    if name not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.attn_implementation={name!r} is not one BERT supports; choose one of "
            f"{', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    dev = torch.device(device) if device is not None else None
    if name == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise HardwareError(
                "model.attn_implementation=flash_attention_2 needs the flash-attn package "
                "(pip install flash-attn, CUDA only); use sdpa or flex_attention instead"
            )
        if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
            raise HardwareError(
                "model.attn_implementation=flash_attention_2 runs only on CUDA GPUs; use sdpa on this device"
            )
    if name == "flex_attention":
        import importlib

        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            raise HardwareError(
                f"model.attn_implementation=flex_attention needs torch >= 2.5 (this is {torch.__version__}); "
                "use sdpa"
            ) from None
    return name


def drop_full_attention_mask(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return ``batch`` without its ``attention_mask`` when it has no padding (decided on the host batch).

    Without a mask SDPA may pick its flash kernel, and transformers skips its own ``mask.all()``
    check, which would otherwise read a CUDA tensor back to the host every forward pass. Call it on
    the CPU batch before the copy to the device (no sync there).
    """
    mask = batch.get("attention_mask")
    if mask is None or mask.device.type != "cpu" or not bool(mask.all()):
        return batch
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def sdpa_padding_mask(attention_mask: torch.Tensor | None, attn_implementation: str) -> torch.Tensor | None:
    """The 4-D boolean mask transformers would build for SDPA from a 2-D padding mask, built here.

    Given a 2-D mask, transformers first asks ``padding_mask.all()`` (a device-to-host read every
    padded forward) to see whether it may drop the mask; a 4-D mask is used as it is. The values
    are the same (True = attend, shape ``batch x 1 x query x key``), so the numbers are too. Other
    attention implementations (eager's additive mask, flash/flex unpadding) keep the 2-D mask; one
    registered with SDPA's mask builder (bert_mp's CPU fast dropout over sdpa) gets the 4-D mask.
    """
    if attention_mask is None or attention_mask.dim() != 2 or not _builds_sdpa_mask(attn_implementation):
        return attention_mask
    b, s = attention_mask.shape
    return attention_mask.to(torch.bool)[:, None, None, :].expand(b, 1, s, s)


def _builds_sdpa_mask(attn_implementation: str | None) -> bool:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    try:
        return ALL_MASK_ATTENTION_FUNCTIONS[attn_implementation] is sdpa_mask
    except KeyError:
        return False


COMPILE_MODES = ("none", "model", "layers")
INDUCTOR_MODES: dict[str, dict[str, Any]] = {
    # torch's reduce-overhead (CUDA graphs) plus the coordinate-descent tuning torch's max-autotune
    # also does, without max-autotune's GEMM benchmarking (the long part of its compile)
    "coordinate-descent": {"triton.cudagraphs": True, "coordinate_descent_tuning": True},
}
"""``train.compile_mode`` values that are inductor options rather than a torch.compile mode."""


def compile_model(
    model: nn.Module,
    mode: str,
    dynamic: bool = False,
    deterministic: bool = False,
    compile_mode: str = "default",
) -> nn.Module:
    """Apply ``torch.compile`` per ``train.compile``, in place (``Module.compile``), so state-dict keys,
    checkpoints and the export are unchanged: ``none``, ``model`` (the whole forward including the
    loss) or ``layers`` (each ``BertLayer``; one compiled graph serves all layers, shorter compile).

    Shapes are static (``dynamic=False``): under compile the collator pads to one of a few lengths
    and the model gathers and pads to fixed sizes (:mod:`bert_mp.model.buckets`,
    ``unpad.prepare_for_compile``), so a run compiles a bounded number of graphs. ``deterministic``:
    see :func:`deterministic_inductor`. ``compile_mode``: torch.compile's ``mode``, or inductor's options
    for a bert_mp mode (:data:`INDUCTOR_MODES`) (``train.compile_mode``; ``reduce-overhead``,
    ``coordinate-descent`` and ``max-autotune`` add CUDA graphs, which :func:`mark_step` keeps apart
    from step to step).
    """
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile={mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if mode == "none":
        return model
    importlib.import_module(_CUDAGRAPH_TREES)  # mark_step marks from the first step (see there)
    if deterministic:
        deterministic_inductor()
    options: dict[str, Any] = {"dynamic": dynamic}
    if compile_mode in INDUCTOR_MODES:
        options["options"] = dict(INDUCTOR_MODES[compile_mode])
    elif compile_mode != "default":
        options["mode"] = compile_mode
    if mode == "model":
        model.compile(**options)
        return model
    from transformers.models.bert.modeling_bert import BertLayer

    compiled = 0
    for module in model.modules():
        if isinstance(module, BertLayer):
            module.compile(**options)
            compiled += 1
    if not compiled:
        raise ConfigError(
            "train.compile=layers: the model has no BertLayer to compile; use train.compile=model"
        )
    return model


def compile_counters() -> dict[str, int]:
    """Graphs dynamo has built, graph breaks it has met and CUDA graphs inductor skipped in this process
    so far (cumulative: a run reports the difference between its end and its start)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        # CUDA graphs that inductor declined (a CPU tensor, a mutated input ...): the step runs without them
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


_CUDAGRAPH_TREES = "torch._inductor.cudagraph_trees"


def mark_step() -> None:
    """Tell CUDA graphs (``train.compile_mode=reduce-overhead`` / ``max-autotune``) that a new step
    begins: the outputs of the previous replay are no longer read, so the next replay may reuse their
    memory. Call before each forward; without CUDA graphs it only bumps their counter.

    A process that compiles nothing never imports inductor's CUDA-graph trees (0.5 CPU s of imports,
    ``torch._inductor.compile_fx`` with them), so no tree can exist to read the counter: the mark is
    skipped there. :func:`compile_model` imports the trees before the first step, so a compiled run
    marks every step from the first."""
    if _CUDAGRAPH_TREES not in sys.modules:
        return
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()


def deterministic_inductor() -> None:
    """Make inductor's CPU code repeat itself to the bit: ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` for the rest of the process.

    Inductor lowers the scatter-adds of the backward pass (embedding gradients, the gradient of every
    ``index_select`` / gather) to ``atomic_add`` inside loops split across OpenMP threads, so with more
    than one thread the order of the additions, and the last bits of the gradients, change from run to
    run (and a resumed run cannot repeat an uninterrupted one). With the flag, which inductor reads when
    it compiles, it calls ATen's serial kernels for them instead. Warn-only: an op without a
    deterministic kernel warns rather than fails. On CPU eager, ATen's kernels are deterministic already;
    the flag also fills ``torch.empty`` with NaN (``torch.utils.deterministic.fill_uninitialized_memory``).
    """
    torch.use_deterministic_algorithms(True, warn_only=True)


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


def static_mask_cap(data_cfg: Any, device: torch.device) -> int | None:
    """Masked positions per sequence the masking never exceeds (for a static-shape gather), or None.

    Only on CUDA, where the dynamic gather's ``nonzero`` is a host sync; on a CPU it costs nothing
    and keeps the loss sum's exact summation order. Whole-word masking can exceed the cap (a word
    longer than the budget is masked whole), so it always gets the dynamic gather.
    """
    if torch.device(device).type != "cuda" or data_cfg.whole_word_masking:
        return None
    return masked_per_row(data_cfg)


class PretrainingModel(nn.Module):
    """``BertForPreTraining`` plus a loss that reports sums, so a step can normalise them globally.

    ``forward`` returns fp32 scalars: ``mlm_loss_sum`` (cross-entropy summed over masked tokens),
    ``mlm_correct``, ``mlm_count``, ``nsp_loss_sum``, ``nsp_correct``, ``nsp_count``.

    Without ``next_sentence_label`` (data prepared with ``objective=mlm``) no NSP loss is computed:
    ``nsp_count`` is 0 and ``nsp_loss_sum`` is ``0 * logits.sum()``, which keeps the NSP head and the
    pooler in the graph with zero gradients, so DDP sees every parameter used in every step.
    """

    def __init__(
        self,
        model: BertForPreTraining,
        sparse_mlm_head: bool = True,
        max_predictions_per_seq: int | None = None,
        unpad: bool = False,
        attention_kernel: str = "auto",
        token_budget: bool = False,
    ):
        super().__init__()
        self.model = model
        self.unpad = unpad
        self.token_budget = token_budget
        """``data.token_budget`` rows (``bert_mp/model/rows.py``): the varlen route's attention installed."""
        self.attention_kernel = attention_kernel
        """``model.attention_kernel`` as resolved for the device (:func:`resolve_attention_kernel`)."""
        """Run the encoder on real tokens only (``bert_mp/model/unpad.py``); same parameters."""
        self.stream_bucket: Any = None
        """With ``unpad``: a ``(total, capacity) -> stream length`` rounding for compiled runs, or None."""
        if unpad:
            from bert_mp.model.unpad import install_unpadded_attention

            install_unpadded_attention(model)
        if token_budget:
            from bert_mp.model.rows import install_rows_attention

            install_rows_attention(model)
        self.sparse_mlm_head = sparse_mlm_head
        self.max_predictions_per_seq = max_predictions_per_seq
        """With it, the masked rows are gathered into a fixed ``batch x max_predictions_per_seq`` buffer
        (``nonzero_static``): no device-to-host sync for the row count and static shapes for
        ``torch.compile``. The masking never labels more positions per sequence than this."""

    def _masked_rows(
        self, flat_labels: torch.Tensor, batch: int, extra: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of the labelled positions and their targets (-100 where a static buffer is padded).

        The static buffer holds ``batch x max_predictions_per_seq + extra`` rows: token-budget rows pass
        their NSP slots as ``extra`` (each example may mask one token more than its share rounds to)."""
        labelled = flat_labels != -100
        if self.max_predictions_per_seq:
            size = min(flat_labels.numel(), batch * self.max_predictions_per_seq + extra)
            try:
                rows = torch.nonzero_static(labelled, size=size, fill_value=-1).squeeze(1)
            except (NotImplementedError, RuntimeError):  # a backend without nonzero_static
                rows = None
            if rows is not None:
                filled = rows >= 0
                rows = rows.clamp(min=0)
                targets = torch.where(filled, flat_labels.index_select(0, rows), -100)
                return rows, targets
        rows = labelled.nonzero().squeeze(1)  # the row count is read on the host: a sync on CUDA
        return rows, flat_labels.index_select(0, rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        labels: torch.Tensor,
        next_sentence_label: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        unpad_layout: Any = None,
        position_ids: torch.Tensor | None = None,
        cls_index: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """``unpad_layout``: the layout a collator computed with the batch (``model/unpad.py``
        ``host_layout``); the unpadded path then computes none itself, the padded path ignores it.
        ``position_ids``, ``cls_index``, ``cu_seqlens``: a ``data.token_budget`` batch (``data/rows.py``),
        run by ``model/rows.py``."""
        extra = 0
        if cls_index is not None:
            from bert_mp.model.rows import run_rows

            seq, pooled = run_rows(
                self, input_ids, token_type_ids, segment_ids, position_ids, cls_index, cu_seqlens
            )
            flat_labels, n_rows, extra = labels.reshape(-1), input_ids.shape[0], cls_index.numel()
        elif self.unpad:  # its graph break (the host-side layout) comes before its kernel context
            from bert_mp.model.unpad import run_unpadded

            seq, pooled, flat_labels = run_unpadded(
                self, input_ids, token_type_ids, labels, attention_mask, segment_ids, unpad_layout
            )
        else:
            attention_mask = sdpa_padding_mask(attention_mask, self.model.config._attn_implementation)
            with attention_backends(self.attention_kernel):
                out = self.model.bert(
                    input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=True
                )
            seq, pooled = out.last_hidden_state, out.pooler_output
            flat_labels = labels.reshape(-1)
        if cls_index is None:
            n_rows = pooled.shape[0]
        heads = self.model.cls
        if self.sparse_mlm_head:
            rows, targets = self._masked_rows(flat_labels, n_rows, extra)
            hidden = seq.reshape(-1, seq.shape[-1]).index_select(0, rows)
            # losses and the vocab softmax in fp32 whatever the autocast dtype
            logits = heads.predictions(hidden).float()
        else:
            targets = flat_labels
            logits = heads.predictions(seq).float().reshape(-1, self.model.config.vocab_size)
        mlm_loss_sum = F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100)
        valid = targets != -100
        mlm_correct = ((logits.argmax(-1) == targets) & valid).sum()
        mlm = {
            "mlm_loss_sum": mlm_loss_sum,
            "mlm_correct": mlm_correct.float(),
            "mlm_count": valid.sum().float(),
        }
        return {
            **mlm,
            **_nsp_sums(heads.seq_relationship(pooled).float(), next_sentence_label, cls_index is not None),
        }


def _nsp_sums(nsp_logits: torch.Tensor, labels: torch.Tensor | None, slots: bool) -> dict[str, torch.Tensor]:
    """NSP loss sum, correct predictions and count. Without labels (``objective=mlm``) zeros that keep the
    pooler and the NSP head in the graph. ``slots``: token-budget rows, whose filler NSP slots carry -100."""
    if labels is None:
        zero = nsp_logits.sum() * 0.0
        return {"nsp_loss_sum": zero, "nsp_correct": zero.detach(), "nsp_count": zero.detach()}
    n_labels = labels.numel()
    if nsp_logits.shape[0] > n_labels:  # filler sequences of a compiled unpadded batch: no label
        labels = F.pad(labels, (0, nsp_logits.shape[0] - n_labels), value=-100)
    if slots:
        count = (labels != -100).sum().float()
    else:  # a fill on the device, not torch.tensor(..., device=): a blocking host-to-device copy
        count = torch.full((), float(n_labels), device=nsp_logits.device)
    return {
        "nsp_loss_sum": F.cross_entropy(nsp_logits, labels, reduction="sum", ignore_index=-100),
        "nsp_correct": (nsp_logits.argmax(-1) == labels).sum().float(),
        "nsp_count": count,
    }
