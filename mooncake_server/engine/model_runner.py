"""Runs a HuggingFace causal LM over the paged KV cache, one packed forward pass at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mooncake_server.engine.attention import PagedContext, SeqSlice, register_paged_attention
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.sequence import Sequence

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model_path: str) -> torch.dtype:
    """Map --dtype to a torch dtype; 'auto' takes the checkpoint's dtype (float32 if unset)."""
    if name != "auto":
        return _DTYPES[name]
    cfg = AutoConfig.from_pretrained(model_path)
    dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dt, str):
        return _DTYPES.get(dt, torch.float32)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def load_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """Load HF weights with our paged attention plugged in; inference mode, eval."""
    impl = register_paged_attention()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=impl)
    model.eval()
    return model


@dataclass(frozen=True)
class StepItem:
    """Compute `num_new` pending tokens of `seq` in this forward pass."""

    seq: Sequence
    num_new: int


class ModelRunner:
    """Owns the model and the KV pool; `step` is blocking and must run off the event loop."""

    def __init__(self, model: torch.nn.Module, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.layout: KVLayout = kv.layout

    @torch.inference_mode()
    def step(self, items: Seq[StepItem],
             on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One packed forward pass; returns float32 logits [len(items), vocab] of each item's last token.

        Every item's `seq.block_ids` must already cover `num_computed + num_new` tokens.
        `on_layer(l)` is called as soon as layer l's new K/V are written to the pool.
        """
        bt = self.layout.block_tokens
        block_rows = self.layout.num_layers * 2 * bt  # pool rows per block
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        slot_rows: list[torch.Tensor] = []
        for it in items:
            s = it.seq
            start = s.num_computed
            end = start + it.num_new
            if len(s.block_ids) * bt < end:
                raise RuntimeError(f"{s.request_id}: blocks cover {len(s.block_ids) * bt} < {end}")
            pos = torch.arange(end)
            table = torch.tensor(s.block_ids[:-(-end // bt)], dtype=torch.long)
            ctx_rows = table[pos // bt] * block_rows + pos % bt
            slices.append(SeqSlice(q_start=len(input_ids), q_len=it.num_new, ctx_len=end,
                                   ctx_rows=ctx_rows))
            slot_rows.append(ctx_rows[start:end])
            input_ids.extend(s.token_ids[start:end])
            positions.extend(range(start, end))
        ctx = PagedContext(pool_rows=self.kv.pool_rows, block_tokens=bt,
                           slot_rows=torch.cat(slot_rows), seqs=slices, on_layer=on_layer)
        last_rows = torch.tensor([sl.q_start + sl.q_len - 1 for sl in slices], dtype=torch.long)
        out = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long),
            position_ids=torch.tensor([positions], dtype=torch.long),
            use_cache=False,
            logits_to_keep=last_rows,
            paged_ctx=ctx,
        )
        return out.logits[0].float()
