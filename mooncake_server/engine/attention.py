"""Paged attention for HuggingFace models, registered through transformers' AttentionInterface.

The HF model runs unchanged; only its attention call is ours. A forward pass carries a packed,
variable-length batch (`input_ids: [1, T]`, several sequences back to back). For each layer we
write the new K/V into their cache slots and attend each sequence's queries over its own blocks.
"""

from __future__ import annotations

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
    block_table: torch.Tensor  # [num_blocks] long: the blocks holding its context, in order


@dataclass
class PagedContext:
    """Per-forward metadata the attention function needs, passed through the model's kwargs."""

    kv_pool: torch.Tensor  # [num_blocks, layers, 2, block_tokens, kv_heads, head_dim]
    slot_blocks: torch.Tensor  # [T] long: block id of each new token's slot
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    seqs: list[SeqSlice]


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
    layer = module.layer_idx  # type: ignore[attr-defined]
    k_cache = paged_ctx.kv_pool[:, layer, 0]  # [num_blocks, block_tokens, kv_heads, head_dim]
    v_cache = paged_ctx.kv_pool[:, layer, 1]
    k_cache[paged_ctx.slot_blocks, paged_ctx.slot_offsets] = key[0].transpose(0, 1)
    v_cache[paged_ctx.slot_blocks, paged_ctx.slot_offsets] = value[0].transpose(0, 1)

    kv_heads, head_dim = key.shape[1], key.shape[3]
    outputs = []
    for s in paged_ctx.seqs:
        q = query[:, :, s.q_start:s.q_start + s.q_len]
        # Gather this sequence's blocks: [nb, block_tokens, kv_heads, d] -> [1, kv_heads, ctx, d]
        k = k_cache[s.block_table].reshape(-1, kv_heads, head_dim)[:s.ctx_len]
        v = v_cache[s.block_table].reshape(-1, kv_heads, head_dim)[:s.ctx_len]
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
