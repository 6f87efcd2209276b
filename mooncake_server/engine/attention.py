"""Paged attention for HuggingFace models, registered through transformers' AttentionInterface.

The HF model runs unchanged; only its attention call is ours. A forward pass carries a packed,
variable-length batch (`input_ids: [1, T]`, several sequences back to back). For each layer we
write the new K/V into their cache slots and attend each sequence's queries over its own blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "mooncake_paged"


@dataclass
class SeqSlice:
    """One sequence inside a packed forward pass."""

    q_start: int  # first row of this sequence in the packed batch
    q_len: int  # new tokens computed now
    ctx_len: int  # tokens attended to (cached + new)
    ctx_rows: torch.Tensor  # [ctx_len] long: pool row of each context token's layer-0 K


@dataclass
class PagedContext:
    """Per-forward metadata the attention function needs, passed through the model's kwargs.

    The pool is addressed as rows of `kv_heads * head_dim` values. Token t of layer l lives at
    row `base(t) + (2 * l + kv) * block_tokens`, with `base(t) = block * layers * 2 * block_tokens
    + offset` — so a layer's rows are found by adding one constant to precomputed indices.
    """

    pool_rows: torch.Tensor  # [num_blocks * layers * 2 * block_tokens, kv_heads * head_dim]
    block_tokens: int
    slot_rows: torch.Tensor  # [T] long: pool row of each new token's layer-0 K
    seqs: list[SeqSlice]
    # Called with the layer index once that layer's new K/V are in the pool (layer-wise KV
    # streaming); runs on the forward thread, so it must only queue work, never wait.
    on_layer: Callable[[int], None] | None = None


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor | None:
    """Bool mask letting query i (at position ctx_len - q_len + i) see keys up to itself."""
    if q_len == 1:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, q_heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_ctx: PagedContext | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Write new K/V into the paged pool, then attend each sequence over its cached context."""
    if paged_ctx is None:
        raise RuntimeError("mooncake paged attention called without a PagedContext")
    kv_heads, head_dim = key.shape[1], key.shape[3]
    layer_idx: int = module.layer_idx  # type: ignore[attr-defined,assignment]
    k_off = 2 * layer_idx * paged_ctx.block_tokens
    v_off = k_off + paged_ctx.block_tokens
    rows = paged_ctx.pool_rows
    # NOTE: index_copy_ on the contiguous row view writes only the new slots; indexing the
    # strided [blocks, layer, ...] view instead would copy the whole pool per layer.
    rows.index_copy_(0, paged_ctx.slot_rows + k_off, key[0].transpose(0, 1).reshape(-1, rows.shape[1]))
    rows.index_copy_(0, paged_ctx.slot_rows + v_off,
                     value[0].transpose(0, 1).reshape(-1, rows.shape[1]))
    if paged_ctx.on_layer is not None:
        paged_ctx.on_layer(module.layer_idx)  # type: ignore[attr-defined, arg-type]

    outputs = []
    for s in paged_ctx.seqs:
        q = query[:, :, s.q_start:s.q_start + s.q_len]
        # [ctx, kv_heads * d] -> [1, kv_heads, ctx, d]
        k = rows.index_select(0, s.ctx_rows + k_off).view(s.ctx_len, kv_heads, head_dim)
        v = rows.index_select(0, s.ctx_rows + v_off).view(s.ctx_len, kv_heads, head_dim)
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        is_causal = s.q_len > 1 and s.q_len == s.ctx_len
        mask = None if is_causal else _causal_mask(s.q_len, s.ctx_len, query.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling,
            enable_gqa=query.shape[1] != kv_heads,
        )
        outputs.append(out)
    attn = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return attn.transpose(1, 2).contiguous(), None  # [1, T, q_heads, head_dim]


def register_paged_attention() -> str:
    """Make the paged kernel available to every HF model; returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
