"""RMSNorm in one fixed order per row (native/linear/row_norm.c), for `--dtype auto`'s forward.

torch's CPU rms_norm runs as several ops, ~25 us a call on one token's row of the bundled
model and 61 calls a decode step. Where a model's linears run the fixed-order kernel
(w8_linear.py), its norms run this one: a row's result does not depend on the rows beside it,
as for those linears. The float32 mode keeps torch's kernel, which gives HF's bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    from mooncake_server.engine import _row_norm  # type: ignore[attr-defined]
except ImportError:  # built only on x86-64
    _row_norm = None


def row_norm_fits(weight: torch.Tensor) -> bool:
    """The native norm takes this weight: float32, a width of whole 8-float vectors."""
    return _row_norm is not None and weight.dtype == torch.float32 and weight.numel() % 8 == 0


def row_norm_call(weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., d] float32 -> HF's RMSNorm of each row, summed in one fixed order."""
    w = weight.detach().contiguous()
    d = w.numel()
    norm = _row_norm.rms_norm

    def call(x: torch.Tensor) -> torch.Tensor:
        rows = x.contiguous()
        y = torch.empty_like(rows)
        norm(rows.data_ptr(), rows.numel() // d, d, w.data_ptr(), eps, y.data_ptr())
        return y

    call.weight = w  # type: ignore[attr-defined]  # keeps the weight alive with the call
    return call
