"""Paged attention for HuggingFace models, registered through transformers' AttentionInterface.

The HF model runs unchanged; only its attention call is ours. A forward pass carries a packed,
variable-length batch (`input_ids: [1, T]`, several sequences back to back). For each layer we
write the new K/V into their cache slots, then attend in as few calls as the batch allows:

- every decoding sequence (one new token) in ONE batched call: their blocks gathered at block
  granularity into a padded [B, kv_heads, blocks * block_tokens, head_dim] view, the padding
  masked out;
- a prompt with no cached context straight over its own new K/V (causal);
- a prompt chunk with cached context over its gathered blocks, causally masked.

The gather indices and masks depend only on the batch, so `AttentionPlan` builds them once per
forward pass; per layer only a constant is added to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "mooncake_paged"


@dataclass(frozen=True)
class PromptSlice:
    """A prompt (chunk) inside a packed forward pass: rows `[q_start, q_start + q_len)`."""

    q_start: int
    q_len: int
    ctx_len: int  # tokens attended to (cached + new)
    # Cached context only: pool block-row of each context block's layer-0 K, and the causal mask.
    ctx_blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeBatch:
    """The decoding sequences of a pass: its first `size` rows, one token each."""

    size: int
    ctx_blocks: torch.Tensor  # [size * max_blocks] long, padded with a valid block
    max_blocks: int
    mask: torch.Tensor | None  # [size, 1, 1, max_blocks * block_tokens] bool; None: no padding


@dataclass
class AttentionPlan:
    """Per-forward metadata the attention function needs, passed through the model's kwargs.

    The pool has two views of the same memory. `pool_rows` holds one token's K (or V) of one
    layer per row: token t of layer l lives at row `base(t) + (2 * l + kv) * block_tokens`, with
    `base(t) = block * layers * 2 * block_tokens + offset`; new tokens are written there.
    `pool_blocks` holds one block's K (or V) of one layer per row: `(block * layers + l) * 2 + kv`;
    context is read there, a block (not a token) per index.
    """

    pool_rows: torch.Tensor  # [num_blocks * layers * 2 * block_tokens, kv_heads * head_dim]
    pool_blocks: torch.Tensor  # [num_blocks * layers * 2, block_tokens * kv_heads * head_dim]
    block_tokens: int
    slot_rows: torch.Tensor  # [T] long: pool row of each new token's layer-0 K
    decode: DecodeBatch | None
    prompts: list[PromptSlice]
    # Called with the layer index once that layer's new K/V are in the pool (layer-wise KV
    # streaming); runs on the forward thread, so it must only queue work, never wait.
    on_layer: Callable[[int], None] | None = None


def causal_mask(q_len: int, ctx_len: int, padded_len: int) -> torch.Tensor:
    """Bool mask [q_len, padded_len]: query i (at position ctx_len - q_len + i) sees keys <= it."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    return torch.arange(padded_len)[None, :] <= q_pos


def _gather(plan: AttentionPlan, blocks: torch.Tensor, offset: int, shape: tuple[int, ...],
            ) -> torch.Tensor:
    """Context K or V of `blocks` (+ layer offset) as [n, kv_heads, n_blocks * bt, head_dim]."""
    n, tokens, kv_heads, head_dim = shape
    rows = plan.pool_blocks.index_select(0, blocks + offset)
    return rows.view(n, tokens, kv_heads, head_dim).transpose(1, 2)


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
    """Write new K/V into the paged pool, then attend each sequence over its cached context."""
    plan = paged_ctx
    if plan is None:
        raise RuntimeError("mooncake paged attention called without an AttentionPlan")
    kv_heads, head_dim = key.shape[1], key.shape[3]
    layer_idx: int = module.layer_idx  # type: ignore[attr-defined,assignment]
    bt = plan.block_tokens
    rows = plan.pool_rows
    width = rows.shape[1]
    # NOTE: index_copy_ on the contiguous row view writes only the new slots; indexing the
    # strided [blocks, layer, ...] view instead would copy the whole pool per layer.
    rows.index_copy_(0, plan.slot_rows + 2 * layer_idx * bt,
                     key[0].transpose(0, 1).reshape(-1, width))
    rows.index_copy_(0, plan.slot_rows + (2 * layer_idx + 1) * bt,
                     value[0].transpose(0, 1).reshape(-1, width))
    if plan.on_layer is not None:
        plan.on_layer(layer_idx)

    gqa = query.shape[1] != kv_heads
    out = torch.empty_like(query)
    d = plan.decode
    if d is not None:
        shape = (d.size, d.max_blocks * bt, kv_heads, head_dim)
        k = _gather(plan, d.ctx_blocks, 2 * layer_idx, shape)
        v = _gather(plan, d.ctx_blocks, 2 * layer_idx + 1, shape)
        q = query[0, :, :d.size].transpose(0, 1).unsqueeze(2)  # [B, h, 1, d]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scaling,
                                           enable_gqa=gqa)
        out[0, :, :d.size] = o.squeeze(2).transpose(0, 1)
    for p in plan.prompts:
        sl = slice(p.q_start, p.q_start + p.q_len)
        q = query[:, :, sl]
        if p.ctx_blocks is None:  # nothing cached: the new K/V are the whole context
            o = F.scaled_dot_product_attention(q, key[:, :, sl], value[:, :, sl], is_causal=True,
                                               scale=scaling, enable_gqa=gqa)
        else:
            shape = (1, p.ctx_blocks.numel() * bt, kv_heads, head_dim)
            k = _gather(plan, p.ctx_blocks, 2 * layer_idx, shape)
            v = _gather(plan, p.ctx_blocks, 2 * layer_idx + 1, shape)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scaling,
                                               enable_gqa=gqa)
        out[:, :, sl] = o
    return out.transpose(1, 2), None  # [1, T, q_heads, head_dim]


def _no_mask(*args: object, **kwargs: object) -> None:
    """Masks are built per sequence by the plan; HF's [T, T] packed mask would go unused."""
    return None


def register_paged_attention() -> str:
    """Make the paged kernel available to every HF model; returns its implementation name."""
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
