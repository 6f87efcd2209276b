"""A pure decode pass's layers as direct native calls, for `--dtype auto`'s lean forward.

Once every kernel of a layer is native (fixed-order linears and norms, row_ops, the paged
decode attention), what is left of a one-token step outside them is Python and torch's per-op
work around each call: reshapes, new output tensors, index_copy_ for the new K/V, views. On the
bundled model a step less its timed kernels was ~1.7 ms (~55 us a layer). Here a pass whose rows
all decode runs each layer as ten calls straight into the kernels, on one set of kept buffers
(grown to the most rows seen), with the same kernels, arguments and order as
`LlamaLayer._forward_fused`: the same bits (tested). Passes with prompt rows, and models whose
layers do not all qualify, keep that path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncake_server.engine.attention import AttentionPlan
from mooncake_server.engine.row_norm import row_norm_fits
from mooncake_server.engine.row_ops import row_ops_built

try:
    from mooncake_server.engine import (  # type: ignore[attr-defined]
        _paged_decode,
        _row_norm,
        _row_ops,
        _w8_group,
    )
except ImportError:  # built only on x86-64
    _paged_decode = _row_norm = _row_ops = _w8_group = None

MAX_ROWS = 256  # larger decode passes allocate per call as before (their buffers would be big)


@dataclass(frozen=True)
class _Layer:
    """One layer's constants for the direct calls (weights by address; `keep` holds them)."""

    index: int
    scale: float
    norm_in: tuple[int, float]  # (weight address, eps)
    norm_post: tuple[int, float]
    qkv: tuple[int, ...]  # W8Linear._args: packed, scale, offset, n, bias, bits
    o_proj: tuple[int, ...]
    gate_up: tuple[int, ...]
    down: tuple[int, ...]


class DecodeCalls:
    """A LlamaStack's pure decode passes as direct native calls (built only where `usable`)."""

    def __init__(self, stack: torch.nn.Module) -> None:
        cfg = stack.config
        first = stack.layers[0]
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.inter = first.down.in_features
        self.keep: list[torch.Tensor] = []
        self.layers: list[_Layer] = []
        self.usable = bool(_paged_decode is not None and row_ops_built() and all(
            layer.calls is not None and layer.calls.o_add is not None
            and row_norm_fits(layer.input_norm.weight) and row_norm_fits(layer.post_norm.weight)
            for layer in stack.layers))
        if not self.usable:
            return
        for layer in stack.layers:
            self.layers.append(_Layer(
                layer.layer_idx, layer.scale, self._norm(layer.input_norm),
                self._norm(layer.post_norm), layer.qkv._args, layer.o_proj._args,
                layer.gate_up._args, layer.down._args))
        self._buffers: tuple[torch.Tensor, ...] = ()

    def _norm(self, norm: torch.nn.Module) -> tuple[int, float]:
        """(address, eps) of a norm's float32 weight, kept alive here."""
        w = norm.weight.detach().contiguous()
        self.keep.append(w)
        return w.data_ptr(), float(norm.variance_epsilon)

    def fits(self, plan: AttentionPlan, rows: int) -> bool:
        """This pass is one these calls run: every row decodes, natively."""
        d = plan.decode
        return (not plan.prompts and d is not None and d.native is not None
                and d.size == rows <= MAX_ROWS)

    def _scratch(self, rows: int) -> tuple[torch.Tensor, ...]:
        """(normed, qkv, attention out, gate|up, activation) buffers of at least `rows` rows
        (one set, grown to the most rows a pass has had: a row count's buffers are its rows'
        prefix, still contiguous)."""
        if not self._buffers or self._buffers[0].shape[0] < rows:
            qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
            self._buffers = (torch.empty(rows, self.hidden), torch.empty(rows, qkv),
                             torch.empty(rows, self.heads * self.head_dim),
                             torch.empty(rows, 2 * self.inter), torch.empty(rows, self.inter))
        return self._buffers

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            plan: AttentionPlan) -> torch.Tensor:
        """Every layer over x [rows, hidden] (contiguous, updated in place and returned)."""
        rows = x.shape[0]
        normed, qkv, attn, gate_up, act = (t.data_ptr() for t in self._scratch(rows))
        hidden, heads, kvh, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        width = (heads + 2 * kvh) * d
        native = plan.decode.native  # type: ignore[union-attr]
        tables, table_width = native.tables.data_ptr(), native.tables.shape[1]
        lens, layers = native.lens.data_ptr(), native.layers
        pool_rows, pool_runs = plan.head_rows.data_ptr(), plan.head_runs.data_ptr()
        slots = plan.slot_rows.contiguous()
        slot_step = slots.stride(0) * slots.element_size()
        slot0 = slots.data_ptr()
        cos, sin = cos.contiguous(), sin.contiguous()  # held: the kernels read their addresses
        cos_p, sin_p = cos.data_ptr(), sin.data_ptr()
        assert x.is_contiguous()
        xp = x.data_ptr()
        norm, linear, rope = _row_norm.rms_norm, _w8_group.linear, _row_ops.rope
        kv_write, silu_mul, attend = _row_ops.kv_write, _row_ops.silu_mul, _paged_decode.decode
        bt, on_layer = plan.block_tokens, plan.on_layer
        for c in self.layers:
            norm(xp, rows, hidden, *c.norm_in, normed)
            linear(normed, rows, hidden, *c.qkv[:5], qkv, c.qkv[5], 0)
            rope(qkv, rows, width, heads + kvh, d, cos_p, sin_p)
            kv_write(qkv, rows, width, kvh, d, heads * d, (heads + kvh) * d, pool_rows,
                     slot0 + c.index * slot_step)
            if on_layer is not None:
                on_layer(c.index)
            attend(qkv, width, pool_runs, tables, table_width, lens, rows, c.index, layers, kvh,
                   heads, d, bt, c.scale, attn)
            linear(attn, rows, heads * d, *c.o_proj[:5], xp, c.o_proj[5], 1)
            norm(xp, rows, hidden, *c.norm_post, normed)
            linear(normed, rows, hidden, *c.gate_up[:5], gate_up, c.gate_up[5], 0)
            silu_mul(gate_up, rows, self.inter, act)
            linear(act, rows, self.inter, *c.down[:5], xp, c.down[5], 1)
        return x
