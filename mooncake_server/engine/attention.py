"""Paged attention: write a pass's new K/V into the pool, then attend over cached context.

A forward pass carries a packed, variable-length batch (several sequences back to back, `T` rows
in all). For each layer `attend` writes the new K/V into their cache slots, then attends in as
few calls as the batch allows:

- the decoding sequences (one new token each): in `--dtype auto`'s forward, one native call
  per layer straight over the pool's blocks (native/linear/paged_decode.c: each row's own
  tokens, in one fixed order); otherwise in groups of equal padded context width (a
  multiple of 256 tokens, fixed by each sequence's own length, so a row's arithmetic does not
  depend on its batch): a group's K and V gathered in ONE `index_select` of per-head block
  runs, which lands as [2, B, kv_heads, blocks * block_tokens, head_dim] with no further copy
  (the pool keeps a head's tokens contiguous); padding masked by an additive bias; scores and
  weighted sum are two batched matmuls. torch's CPU flash kernel is tuned for
  long query blocks: at one query row per sequence it took 1.4-1.5x as long as the matmuls;
- a prompt with no cached context straight over its own new K/V (causal, flash kernel);
- a prompt chunk with cached context over its gathered blocks, causally masked.

The gather indices and masks depend only on the batch, so `AttentionPlan` builds them once per
forward pass; per layer only the layer index is added to them. `llama_stack.LlamaStack` calls
`attend` directly; other HF models reach it through transformers' AttentionInterface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from mooncake_server.engine.kv_cache import KVLayout

try:
    from mooncake_server.engine import _paged_decode  # type: ignore[attr-defined]
except ImportError:  # built only on x86-64
    _paged_decode = None

ATTN_IMPLEMENTATION = "mooncake_paged"
# Decode contexts are padded to a multiple of this many tokens (see DecodeBatch).
DECODE_BUCKET_TOKENS = 256


@dataclass(frozen=True)
class PromptSlice:
    """A prompt (chunk) inside a packed forward pass: rows `[q_start, q_start + q_len)`."""

    q_start: int
    q_len: int
    # Cached context only: [layers, n] `head_runs` rows of the context per layer, and the
    # causal mask.
    ctx_runs: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeGroup:
    """Decoding rows `[start, start + size)` whose contexts pad to the same width."""

    start: int
    size: int
    # [layers, 2 * size * kv_heads * blocks] long `head_runs` rows per layer, ordered (K|V, seq,
    # head, block); short tables padded with a valid block
    ctx_runs: torch.Tensor
    bias: torch.Tensor | None  # [size, 1, 1, blocks * block_tokens] 0 / -inf; None: no padding


@dataclass(frozen=True)
class NativeDecode:
    """The decoding rows' block tables for the native kernel (`--dtype auto`'s forward)."""

    tables: torch.Tensor  # [size, width] int64 block ids, short tables padded with a valid one
    lens: torch.Tensor  # [size] int32 context lengths (the new token included)
    layers: int


NATIVE_MAX_HEAD_DIM = 256  # paged_decode.c's MAX_D


def native_decode_supported(layout: KVLayout) -> bool:
    """The native decode kernel is built here (x86-64; it runs where AVX2+FMA does) and takes
    this pool: float32, heads of whole 8-float vectors up to NATIVE_MAX_HEAD_DIM."""
    return (_paged_decode is not None and layout.dtype == torch.float32
            and layout.head_dim % 8 == 0 and layout.head_dim <= NATIVE_MAX_HEAD_DIM)


@dataclass(frozen=True)
class DecodeBatch:
    """The decoding sequences of a pass: its first `size` rows, one token each, in groups.

    A sequence's context is padded to a width fixed by its own length (`decode_width`), never
    by the longest context beside it: the reductions over it (softmax, the weighted sum) then
    run the same shapes, so the same order, alone or in any batch.
    """

    size: int
    groups: list[DecodeGroup]
    native: NativeDecode | None = None  # set: one native call per layer, `groups` unused


@dataclass
class AttentionPlan:
    """Per-forward metadata the attention function needs, passed through the model's kwargs.

    The pool has two views of the same memory (see kv_cache). `head_rows` holds one token's K
    (or V) of one head of one layer per row: token t, head h of layer l lives at row
    `base(t) + ((2 * l + kv) * kv_heads + h) * block_tokens`, with
    `base(t) = block * layers * 2 * kv_heads * block_tokens + offset`; new tokens are written
    there. `head_runs` holds a block's `block_tokens` rows of one head, K or V, of one layer:
    row `((block * layers + l) * 2 + kv) * kv_heads + h`; context is read there, a run (not a
    token) per index.
    """

    head_rows: torch.Tensor  # [num_blocks * layers * 2 * kv_heads * block_tokens, head_dim]
    head_runs: torch.Tensor  # [num_blocks * layers * 2 * kv_heads, block_tokens * head_dim]
    block_tokens: int
    kv_heads: int
    # [layers, 2, T * kv_heads] long: `head_rows` row of each new token head's K, then V, per
    # layer (built once per pass: indexing a layer's row is cheaper than adding its offset)
    slot_rows: torch.Tensor
    decode: DecodeBatch | None
    prompts: list[PromptSlice]
    # Called with the layer index once that layer's new K/V are in the pool (layer-wise KV
    # streaming); runs on the forward thread, so it must only queue work, never wait.
    on_layer: Callable[[int], None] | None = None


def causal_mask(q_len: int, ctx_len: int, padded_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [q_len, padded_len] (0 / -inf): query i (at position ctx_len - q_len + i)
    sees keys <= it.

    Additive in the query's dtype, not bool: SDPA turns a bool mask into this one on every
    call, once per layer, each a fresh [q_len, padded_len] float buffer (33 MB, 8k page
    faults for 2048 x 4096); the result is the same bits.
    """
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    hidden = torch.arange(padded_len)[None, :] > q_pos
    return torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))


def per_layer(rows: torch.Tensor, layers: int, stride: int) -> torch.Tensor:
    """[layers, *rows.shape]: `rows` (layer 0's indices) offset by `stride` per layer."""
    offsets = torch.arange(layers) * stride
    return rows.unsqueeze(0) + offsets.view(layers, *([1] * rows.dim()))


def _gather(plan: AttentionPlan, runs: torch.Tensor, n: int, head_dim: int) -> torch.Tensor:
    """K and V of context `runs` (one layer's) as [2, n, kv_heads, tokens, head_dim] (one copy)."""
    return plan.head_runs.index_select(0, runs).view(2, n, plan.kv_heads, -1, head_dim)


def decode_width(blocks: int, block_tokens: int) -> int:
    """The padded context width, in blocks, of a decoding sequence spanning `blocks` blocks:
    a whole number of DECODE_BUCKET_TOKENS (wasted work stays small next to the linears)."""
    bucket = max(1, DECODE_BUCKET_TOKENS // block_tokens)
    return -(-blocks // bucket) * bucket


def _decode(plan: AttentionPlan, d: DecodeBatch, layer: int, q: torch.Tensor, scale: float,
            ) -> torch.Tensor:
    """Attention of the decoding rows q [B, heads, d] over their context: [B, heads, d]."""
    if d.native is not None:
        return _decode_native(plan, d.native, layer, q, scale)
    if len(d.groups) == 1:
        return _decode_group(plan, d.groups[0], layer, q, scale)
    out = q.new_empty(q.shape)
    for g in d.groups:
        out[g.start:g.start + g.size] = _decode_group(plan, g, layer,
                                                      q[g.start:g.start + g.size], scale)
    return out


def _decode_native(plan: AttentionPlan, n: NativeDecode, layer: int, q: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """`_decode` in one native call over the pool (float32)."""
    b, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(b, heads, head_dim)
    _paged_decode.decode(q.data_ptr(), q.stride(0), plan.head_runs.data_ptr(),
                         n.tables.data_ptr(), n.tables.shape[1], n.lens.data_ptr(), b, layer,
                         n.layers, plan.kv_heads, heads, head_dim, plan.block_tokens, scale,
                         out.data_ptr())
    return out


def _decode_group(plan: AttentionPlan, d: DecodeGroup, layer: int, q: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """`_decode` for one group of equal context width."""
    b, heads, head_dim = q.shape
    kv = _gather(plan, d.ctx_runs[layer], b, head_dim)
    # Query head h reads KV head h // group, as in HF's repeat_kv.
    qg = q.view(b, plan.kv_heads, heads // plan.kv_heads, head_dim)
    scores = torch.matmul(qg, kv[0].transpose(-1, -2)).float() * scale
    if d.bias is not None:
        scores += d.bias
    weights = scores.softmax(-1).to(q.dtype)
    return torch.matmul(weights, kv[1]).view(b, heads, head_dim)


def attend(plan: AttentionPlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Write layer `layer`'s new K/V [T, kv_heads, d] to the pool; attend q [T, heads, d] -> same."""
    tokens, kv_heads, head_dim = k.shape
    heads = q.shape[1]
    rows, slots = plan.head_rows, plan.slot_rows[layer]
    # NOTE: index_copy_ on the contiguous row view writes only the new slots; indexing the
    # strided [blocks, layer, ...] view instead would copy the whole pool per layer.
    rows.index_copy_(0, slots[0], k.reshape(tokens * kv_heads, head_dim))
    rows.index_copy_(0, slots[1], v.reshape(tokens * kv_heads, head_dim))
    if plan.on_layer is not None:
        plan.on_layer(layer)

    gqa = heads != kv_heads
    d = plan.decode
    if d is not None and not plan.prompts:  # decode only: the batched result is the output
        return _decode(plan, d, layer, q, scale)
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    if d is not None:
        out[:d.size] = _decode(plan, d, layer, q[:d.size], scale)
    for p in plan.prompts:
        sl = slice(p.q_start, p.q_start + p.q_len)
        qp = q[sl].transpose(0, 1).unsqueeze(0)
        if p.ctx_runs is None:  # nothing cached: the new K/V are the whole context
            o = F.scaled_dot_product_attention(qp, k[sl].transpose(0, 1).unsqueeze(0),
                                               v[sl].transpose(0, 1).unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kv = _gather(plan, p.ctx_runs[layer], 1, head_dim)
            o = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=p.mask, scale=scale,
                                               enable_gqa=gqa)
        out[sl] = o[0].transpose(0, 1)
    return out


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, q_heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_ctx: AttentionPlan | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over `attend`: returns [1, T, q_heads, head_dim]."""
    if paged_ctx is None:
        raise RuntimeError("mooncake paged attention called without an AttentionPlan")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(paged_ctx, module.layer_idx,  # type: ignore[arg-type]
                 query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 scale)
    return out.unsqueeze(0), None


def _no_mask(*args: object, **kwargs: object) -> None:
    """Masks are built per sequence by the plan; HF's [T, T] packed mask would go unused."""
    return None


def register_paged_attention() -> str:
    """Make the paged kernel available to every HF model; returns its implementation name."""
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
