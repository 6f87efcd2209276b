"""A decoder layer's elementwise steps in one native pass each (native/linear/row_ops.c).

In `--dtype auto`'s forward (where the linears and norms run fixed-order kernels) rope rotates
q and k in place with torch's bits, and SiLU-and-mul is one pass with a fixed exp: each per
element, so a row's result does not depend on the rows beside it. torch ran each as several
ops with their own dispatch and output tensors.
"""

from __future__ import annotations

import torch

try:
    from mooncake_server.engine import _row_ops  # type: ignore[attr-defined]
except ImportError:  # built only on x86-64
    _row_ops = None


def row_ops_built() -> bool:
    """The native module is compiled into this install (x86-64)."""
    return _row_ops is not None


def rope_fits(head_dim: int) -> bool:
    """The native rope takes heads of this width (whole 8-float halves)."""
    return _row_ops is not None and head_dim % 16 == 0


def silu_mul_fits(inter: int) -> bool:
    """The native SiLU-and-mul takes this intermediate width (whole 8-float vectors)."""
    return _row_ops is not None and inter % 8 == 0


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of x [rows, >= heads * d] in place:
    x * cos + swap_halves(x) * sin, cos and sin [rows, d] (sin signed as llama_stack's)."""
    rows, d = cos.shape[0], cos.shape[-1]
    assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    _row_ops.rope(x.data_ptr(), rows, x.stride(0), heads, d, cos.data_ptr(), sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate|up [rows, 2 * inter] (contiguous float32) -> [rows, inter]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    _row_ops.silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
    return out
