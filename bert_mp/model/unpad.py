"""The unpadded encoder (``model.unpad``): the stock ``BertForPreTraining`` run on real tokens only.

A padded batch ``(rows, length)`` is flattened to one stream of its ``T`` real tokens; the
embeddings, every Linear, LayerNorm, GELU and dropout then run on ``(T, hidden)`` instead of
``(rows * length, hidden)``. Only attention needs to know where one sequence ends: it is routed
through a registered transformers attention function (the ``ALL_ATTENTION_FUNCTIONS`` seam
``BertSelfAttention`` already calls), which scatters each sequence's queries, keys and values into
a ``(sequences, max_length)`` block with a key mask and hands that to the configured kernel (SDPA,
eager, or the fast-dropout one). No token attends across sequences, and the block is only as long
as the longest sequence of the batch, not ``max_seq_length``.

A "sequence" is a row, or, for packed rows (``data.pack_pairs``), one pair of a row, or, with
``data.mlm_document_attention=block``, one document of an MLM-only row (``segment_ids`` numbers them
within a row from 1; 0 is padding): position ids restart at every sequence and the NSP head reads
each sequence's first token (its ``[CLS]``; MLM-only rows train no NSP).

Parameters and state-dict keys are the stock ones, and ``config.json`` does not record the attention
function, so checkpoints and the export are unchanged: a padded model loaded from them computes the
same logits.

For ``torch.compile`` the stream can be padded with filler tokens up to a bucket
(:func:`token_bucket`): fillers get a scratch slot each in the attention block (they attend to nothing
real and nothing attends to them), carry no label and are dropped before the heads, so a run sees a
bounded number of shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from bert_mp.model.attention import attention_backends
from bert_mp.model.buckets import allow_recompiles, masked_per_row, sequence_bucket

PREFIX = "bert_mp_unpad_"


@dataclass
class Unpadded:
    """Where the real tokens of a padded batch sit, and how attention regroups them."""

    indices: torch.Tensor
    """(T,) positions of the real tokens in the flattened ``(rows * length)`` batch."""
    lengths: torch.Tensor
    """(sequences,) real tokens per sequence (row, or pair of a packed row)."""
    cu_seqlens: torch.Tensor
    """(sequences + 1,) cumulative lengths: sequence ``i`` is ``stream[cu[i]:cu[i+1]]``."""
    position_ids: torch.Tensor
    """(T,) position of each token within its own sequence."""
    block_index: torch.Tensor
    """(T + fillers,) slot of each stream token in the ``(sequences * block_len + fillers)`` attention buffer."""
    key_mask: torch.Tensor
    """(sequences, 1, 1, block_len) True where a key is a real token of that sequence."""
    gather_index: torch.Tensor
    """(T + fillers,) where each stream token reads its attention output: its block slot (fillers: slot 0,
    their outputs never reach a loss)."""
    block_len: int
    fillers: int = 0
    bucketed: bool = False
    """The stream was padded to a bucket (compiled runs): attention keeps the block route, whose
    shapes do not depend on the filler count (the flash route's cu_seqlens would)."""
    varlen: bool = True
    """The varlen flash kernel may serve attention where it applies (``model.attention_kernel`` auto or
    flash); False: the block route through SDPA, under the chosen kernel."""
    _cu_seqlens_int32: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def cu_seqlens_int32(self) -> torch.Tensor:
        """``cu_seqlens`` as the flash kernel takes it (int32): converted once per layout, not in every
        layer (a copy of this layout, e.g. :func:`pad_sequences`' ``replace``, converts its own)."""
        if self._cu_seqlens_int32 is None:
            self._cu_seqlens_int32 = self.cu_seqlens.to(torch.int32)
        return self._cu_seqlens_int32

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.numel())

    @property
    def cls_index(self) -> torch.Tensor:
        """Stream position of each sequence's first token (its ``[CLS]``; a filler sequence's
        (:func:`pad_sequences`) stays inside the stream)."""
        return self.cu_seqlens[:-1].clamp(max=max(int(self.block_index.numel()) - 1, 0))


def pad_sequences(u: Unpadded, n: int) -> Unpadded:
    """``u`` with empty filler sequences appended up to ``n`` sequences.

    A filler sequence has length 0 and one key, its block slot 0 (a zero vector: its attention is
    finite and reaches nothing); its pooled ``[CLS]`` is read at a valid stream position and
    carries no label. The stream's filler tokens move past the grown block so no two tokens share
    a slot.
    """
    extra = n - u.num_sequences
    if extra <= 0:
        return u
    device = u.lengths.device
    total = int(u.cu_seqlens[-1])
    lengths = torch.cat([u.lengths, u.lengths.new_zeros(extra)])
    cu = torch.cat([u.cu_seqlens, u.cu_seqlens.new_full((extra,), total)])
    self_slot = torch.arange(u.block_len, device=device) == 0
    key_mask = torch.cat([u.key_mask, self_slot.view(1, 1, 1, -1).expand(extra, 1, 1, -1)])
    block_index = u.block_index.clone()
    block_index[total:] = n * u.block_len + torch.arange(u.fillers, device=device)
    return replace(u, lengths=lengths, cu_seqlens=cu, key_mask=key_mask, block_index=block_index)


def token_bucket(total: int, capacity: int, buckets: int = 8, multiple: int = 64) -> int:
    """``total`` rounded up to one of at most ``buckets`` sizes in ``(0, capacity]`` (multiples of ``multiple``).

    With it a compiled model sees at most ``buckets`` stream lengths per block length, whatever the
    batches hold (``capacity`` = rows x padded length, the most a micro-batch can carry).
    """
    step = max(multiple, -(-capacity // buckets // multiple) * multiple)
    return min(-(-max(total, 1) // step) * step, max(capacity, step))


def unpad_index(
    attention_mask: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    block_len: int | None = None,
    stream_len: int | None = None,
) -> Unpadded:
    """The :class:`Unpadded` layout of a padded batch.

    ``segment_ids`` (packed rows): 1, 2, ... per pair within a row, 0 on padding; without it each row
    is one sequence. ``block_len``: the attention block length (default: the longest sequence).
    ``stream_len``: pad the stream with fillers to this many tokens (at least the real count).
    The sequence lengths are read on the host (a sync on CUDA, as for any varlen kernel).
    """
    rows, length = attention_mask.shape
    device = attention_mask.device
    real = attention_mask.reshape(-1) != 0
    indices = real.nonzero().squeeze(1)
    row_of = torch.arange(rows, device=device).repeat_interleave(length)
    key = row_of if segment_ids is None else row_of * (length + 1) + segment_ids.reshape(-1)
    _, lengths = torch.unique_consecutive(key.index_select(0, indices), return_counts=True)
    n_seq, total = int(lengths.numel()), int(indices.numel())
    cu = torch.zeros(n_seq + 1, dtype=torch.long, device=device)
    torch.cumsum(lengths, 0, out=cu[1:])
    seq_of = torch.arange(n_seq, device=device).repeat_interleave(lengths)
    position_ids = torch.arange(total, device=device) - cu.index_select(0, seq_of)
    block = int(block_len) if block_len is not None else int(lengths.max()) if n_seq else 1
    if n_seq and int(lengths.max()) > block:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit block_len={block}")
    fillers = max(0, (stream_len or total) - total)
    block_index = torch.cat(
        [seq_of * block + position_ids, n_seq * block + torch.arange(fillers, device=device)]
    )
    key_mask = (torch.arange(block, device=device)[None, :] < lengths[:, None]).view(n_seq, 1, 1, block)
    gather_index = torch.cat([seq_of * block + position_ids, position_ids.new_zeros(fillers)])
    return Unpadded(indices, lengths, cu, position_ids, block_index, key_mask, gather_index, block, fillers)


def bucketed_layout(
    attention_mask: torch.Tensor, segment_ids: torch.Tensor | None = None, bucket: Any = None
) -> Unpadded:
    """:func:`unpad_index` of a padded batch, with the stream and block sizes of ``bucket`` (see
    :func:`unpad_stream`). The one place both the model and the collator's host layout get it from."""
    stream_len = block_len = None
    if bucket is not None:
        rows, length = attention_mask.shape
        stream_len = bucket(int(attention_mask.sum()), rows * length)
        block_len = -(-length // 64) * 64
    u = unpad_index(attention_mask, segment_ids, block_len=block_len, stream_len=stream_len)
    if bucket is not None:  # and the number of sequences (packed pairs, blocked documents)
        u = pad_sequences(u, sequence_bucket(u.num_sequences, attention_mask.shape[0]))
    u.bucketed = bucket is not None
    return u


LAYOUT_KEYS = ("indices", "lengths", "cu_seqlens", "position_ids", "block_index", "key_mask", "gather_index")
"""The :class:`Unpadded` tensors a :class:`HostLayout` carries."""


@dataclass
class HostLayout:
    """An :class:`Unpadded` layout computed with the batch (:func:`host_layout`), carried in it as
    ``unpad_layout``. One object rather than loose tensors: compiled code only hands it on to
    :func:`unpad_stream`, so it never guards on (and recompiles for) its data-dependent shapes. Moved
    (``to``) and pinned (``pin_memory``) like a tensor, so the batch's device copy takes it along."""

    tensors: dict[str, torch.Tensor]
    """The :data:`LAYOUT_KEYS` tensors of the layout."""

    def to(self, *args: Any, **kwargs: Any) -> HostLayout:
        return HostLayout({k: t.to(*args, **kwargs) for k, t in self.tensors.items()})

    def pin_memory(self, *args: Any) -> HostLayout:
        return HostLayout({k: t.pin_memory(*args) for k, t in self.tensors.items()})

    def unpadded(self, bucketed: bool) -> Unpadded:
        """The :class:`Unpadded` of these tensors, without device work: the block length and the filler
        count are read from tensor shapes."""
        t = self.tensors
        u = Unpadded(**{n: t[n] for n in LAYOUT_KEYS}, block_len=t["key_mask"].shape[-1])
        u.fillers = u.block_index.shape[0] - u.indices.shape[0]
        u.bucketed = bucketed or u.fillers > 0
        return u


def host_layout(batch: dict[str, torch.Tensor], bucket: Any = None) -> dict[str, HostLayout]:
    """``{"unpad_layout": HostLayout}`` for a collated host batch: its :class:`Unpadded` layout.

    Computed in the DataLoader's collate step (overlapped with the device's work), so the model's
    unpadded forward reads no sequence length back and launches no layout kernels. ``bucket``: as the
    model's ``stream_bucket`` (compiled runs), so the stream has the model's bucketed sizes.
    """
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch["input_ids"])
    u = bucketed_layout(mask, batch.get("segment_ids"), bucket)
    return {"unpad_layout": HostLayout({name: getattr(u, name) for name in LAYOUT_KEYS})}


@torch.compiler.disable  # host-side bookkeeping: shapes depend on the data; compiled code sees its results
def unpad_stream(
    input_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    segment_ids: torch.Tensor | None = None,
    bucket: Any = None,
    pad_token_id: int = 0,
    layout: HostLayout | None = None,
    varlen: bool = True,
) -> tuple[Unpadded, dict[str, torch.Tensor]]:
    """The layout and the stream's ``input_ids``, ``token_type_ids``, ``position_ids`` and ``labels``.

    ``bucket``: ``(real tokens, capacity) -> stream length`` (e.g. :func:`token_bucket`); the stream is
    then padded with filler tokens (label -100), the attention block rounded up to a multiple of 64 and
    the sequences padded with empty ones (:func:`pad_sequences`), so that everything after this
    function has one of a few shapes. ``layout``: the batch's
    precomputed layout (:func:`host_layout`), used as it is; without it the layout is computed here
    (host syncs on CUDA: the sequence lengths and counts are read back). ``varlen``: see
    :attr:`Unpadded.varlen`.
    """
    if layout is not None:
        u = layout.unpadded(bucketed=bucket is not None)
    else:
        if attention_mask is None:  # the batch had no padding (the mask was dropped on the host)
            attention_mask = torch.ones_like(input_ids)
        u = bucketed_layout(attention_mask, segment_ids, bucket)
    if not varlen:
        u = replace(u, varlen=False)
    fill = u.fillers

    def take(x: torch.Tensor, filler: int) -> torch.Tensor:
        x = x.reshape(-1).index_select(0, u.indices)
        return torch.cat([x, x.new_full((fill,), filler)]) if fill else x

    stream = {
        "input_ids": take(input_ids, pad_token_id),
        "token_type_ids": take(token_type_ids, 0),
        "labels": take(labels, -100),
        "position_ids": torch.cat([u.position_ids, u.position_ids.new_zeros(fill)])
        if fill
        else u.position_ids,
    }
    return u, stream


def encode_unpadded(
    bert: nn.Module, stream: dict[str, torch.Tensor], u: Unpadded
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``bert`` (a ``BertModel``) on a token stream: ``(stream length, hidden)`` states and the
    ``(sequences, hidden)`` pooler outputs read at each sequence's ``[CLS]``."""
    hidden = bert.embeddings(
        input_ids=stream["input_ids"].unsqueeze(0),
        token_type_ids=stream["token_type_ids"].unsqueeze(0),
        position_ids=stream["position_ids"].unsqueeze(0),
    )
    hidden = bert.encoder(hidden, attention_mask=None, bert_mp_unpadded=u).last_hidden_state[0]
    pooled = None
    if bert.pooler is not None:
        pooled = bert.pooler(hidden.index_select(0, u.cls_index).unsqueeze(1))
    return hidden, pooled


def _to_blocks(u: Unpadded, *xs: torch.Tensor) -> list[torch.Tensor]:
    """(1, heads, S, d) streams -> (sequences, heads, block_len, d) each, zeros where no token sits.

    One zero-filled buffer and one scatter for all of them. The buffer has room for every stream token
    past the block (fillers land there): sized by the stream's static length, not the filler count,
    so a compiled graph does not depend on how many fillers there are.
    """
    stream = torch.stack([x[0].transpose(0, 1) for x in xs])  # (k, S, heads, d)
    k, length, heads, dim = stream.shape
    n = u.num_sequences * u.block_len
    buf = stream.new_zeros(k, n + length, heads, dim)
    buf.index_copy_(1, u.block_index, stream)
    block = buf[:, :n].view(k, u.num_sequences, u.block_len, heads, dim).transpose(2, 3)
    return list(block.unbind(0))


try:  # imported here, not where a kernel is chosen: compiled code only reads the name
    from torch.nn.attention.varlen import varlen_attn as VARLEN_ATTN
except ImportError:  # torch < 2.10
    VARLEN_ATTN = None


def flash_varlen_kernel(query: torch.Tensor, dropout: float, base: str) -> Any:
    """torch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``) where it applies:
    CUDA, bf16 / fp16 activations, the ``sdpa`` base and no attention dropout (the kernel has none:
    eval, or ``model.attention_probs_dropout_prob=0``); else None (the block path)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or dropout or base != "sdpa":
        return None
    return VARLEN_ATTN


def _flash_attention(
    kernel: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    u: Unpadded,
    scaling: float | None,
) -> torch.Tensor:
    """(1, heads, S, d) streams -> (1, S, heads, d) through the varlen kernel: no block, no scatter."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (S, heads, d): real tokens only
    cu = u.cu_seqlens_int32()
    kwargs = {} if scaling is None else {"scale": scaling}
    return kernel(q, k, v, cu, cu, u.block_len, u.block_len, **kwargs).unsqueeze(0)


def _varlen_attention(base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.bert.modeling_bert import eager_attention_forward

    additive = base == "eager"  # eager adds its mask; sdpa and the fast-dropout kernel take booleans

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        bert_mp_unpadded: Unpadded | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
        u = bert_mp_unpadded
        if u is None:  # a padded call (e.g. an exported model's own forward): the base kernel as is
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        flash = None if u.bucketed or not u.varlen else flash_varlen_kernel(query, dropout, base)
        if flash is not None:
            return _flash_attention(flash, query, key, value, u, scaling), None
        mask = u.key_mask
        if additive:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min
            )
        q, k, v = _to_blocks(u, query, key, value)
        out, _ = fn(module, q, k, v, mask, scaling=scaling, dropout=dropout, **kwargs)
        # out: (sequences, block_len, heads, d) -> the stream order; fillers read slot 0 (their
        # outputs never reach a loss)
        return out.reshape(-1, out.shape[2], out.shape[3]).index_select(0, u.gather_index).unsqueeze(0), None

    return attention


def install_unpadded_attention(model: nn.Module) -> str:
    """Route ``model``'s attention through the varlen function around its current kernel; returns its name.

    Idempotent. Calls without the unpadded layout (padded inputs) reach the current kernel unchanged.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.config._attn_implementation
    if base.startswith(PREFIX):
        return base
    if base.removeprefix("bert_mp_fast_dropout_") not in ("sdpa", "eager"):
        from bert_mp.errors import ConfigError

        raise ConfigError(
            f"model.unpad=true runs attention through sdpa or eager (got attn_implementation={base}); "
            "set model.attn_implementation=sdpa"
        )
    name = PREFIX + base
    AttentionInterface.register(name, _varlen_attention(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    return name


def run_unpadded(
    wrapper: nn.Module,
    input_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    segment_ids: torch.Tensor | None = None,
    layout: HostLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``PretrainingModel``'s encoder call on the unpadded path: the stream's ``(S, hidden)`` states
    (real tokens first, then any fillers), the pooled ``[CLS]`` of every sequence and the ``(S,)``
    labels (-100 on fillers), for the loss code that follows. ``layout``: the batch's precomputed
    layout, if the collator added one (:func:`host_layout`)."""
    bert = wrapper.model.bert
    u, stream = unpad_stream(
        input_ids,
        token_type_ids,
        labels,
        attention_mask,
        segment_ids,
        bucket=getattr(wrapper, "stream_bucket", None),
        pad_token_id=int(bert.config.pad_token_id or 0),
        layout=layout,
        varlen=getattr(wrapper, "attention_kernel", "auto") in ("auto", "flash"),
    )
    with attention_backends(getattr(wrapper, "attention_kernel", "auto")):
        hidden, pooled = encode_unpadded(bert, stream, u)
    return hidden, pooled, stream["labels"]


def prepare_for_compile(wrapper: nn.Module, data_cfg: Any) -> None:
    """Before ``torch.compile`` of a ``PretrainingModel`` (padded or unpadded): gather the masked rows
    into a fixed buffer and, unpadded, bucket the stream length and the number of sequences, so a run
    compiles a bounded number of graphs (see :mod:`bert_mp.model.buckets`; the collator's padded
    length is the other half). Whole-word masking can exceed ``max_predictions_per_seq``: its buffer
    holds every position."""
    allow_recompiles(data_cfg, wrapper.unpad)
    if wrapper.unpad:
        wrapper.stream_bucket = token_bucket
    if not wrapper.max_predictions_per_seq:
        wrapper.max_predictions_per_seq = (
            data_cfg.max_seq_length if data_cfg.whole_word_masking else masked_per_row(data_cfg)
        )


def collate_layout(wrapper: nn.Module) -> Any:
    """The collator's ``layout`` option for an unpadded ``PretrainingModel``: :func:`host_layout` with the
    model's stream bucket (a picklable callable, for DataLoader workers)."""
    from functools import partial

    return partial(host_layout, bucket=getattr(wrapper, "stream_bucket", None))


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (every recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
