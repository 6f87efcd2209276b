"""A weight-only int8 linear on AVX2+FMA CPUs (native/linear/w8_group.c): `--dtype auto`'s kernel.

Weights are bytes in groups of 32 inputs, each group with its own scale and offset (w = s*q + m);
activations stay float32 and are multiplied in float32. Decode steps read a quarter of float32's
weight bytes, and the only rounding against the float32 mode is the weights', which for a model
converted from a Q4_1/Q8_0 GGUF (the bundled default) is one float32 rounding: its levels land
on exact byte levels. Every output is summed in one fixed order, so a row's result
does not depend on the other rows of its call, the thread count, or which AVX2 CPU runs it.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from mooncake_server.engine import _w8_group  # type: ignore[attr-defined]
except ImportError:  # built only on x86-64
    _w8_group = None

GROUP = 32  # inputs per scale and offset
BLOCK_N = 2  # output channels per packed block
LEVELS = 255


def w8_built() -> bool:
    """The kernel is compiled into this install (x86-64)."""
    return _w8_group is not None


def w8_supported() -> bool:
    """The kernel is built and this CPU has AVX2 and FMA."""
    return _w8_group is not None and bool(_w8_group.supported())


def w8_fits(linear: nn.Linear) -> bool:
    """The kernel takes this linear: its input width is whole groups."""
    return linear.in_features % GROUP == 0


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels uint8 [N, K], scale [N, K/32], offset [N, K/32]): w ~ scale * level + offset.

    Each group takes the nearer of two grids: its range in 255 steps (exact for a 4-bit GGUF's
    min + d * q groups) or +-max|w| in 127 steps around zero (exact for Q8_0's d * q groups;
    the bundled model's embedding, and so its output projection, is Q8_0).
    """
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    ranged = _grid(w, (hi - lo) / LEVELS, lo, 0, LEVELS)
    step = w.abs().amax(dim=-1) / 127
    centred = _grid(w, step, -128 * step, -127, 127, shift=128)
    pick = (centred[3] < ranged[3])[..., None]
    q = torch.where(pick, centred[0], ranged[0])
    scale = torch.where(pick[..., 0], centred[1], ranged[1])
    offset = torch.where(pick[..., 0], centred[2], ranged[2])
    return q.to(torch.uint8).view(n, k), scale, offset


def _grid(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, low: int, high: int,
          shift: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, G, 32] on the grid scale * (level - shift) + offset' (levels as stored, scale,
    offset, each group's worst error); `offset` is what the kernel adds, `low`/`high` bound
    level - shift."""
    safe = torch.where(scale > 0, scale, 1.0)
    base = offset + shift * scale  # the grid's zero level
    q = torch.round((w - base[..., None]) / safe[..., None]).clamp(low, high) + shift
    rec = torch.addcmul(offset[..., None], q, scale[..., None])
    return q, scale, offset, (rec - w).abs().amax(dim=-1)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight the kernel multiplies by (for quality checks in torch)."""
    q, scale, offset = quantize_groups(weight)
    n, k = q.shape
    levels = q.view(n, k // GROUP, GROUP).float()
    return torch.addcmul(offset[..., None], levels, scale[..., None]).view(n, k)


class W8Linear(nn.Module):
    """y = x @ W.T + b with grouped int8 weights and float32 activations (float32 in and out)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not w8_supported():
            raise RuntimeError("the weight-only int8 kernel needs AVX2 and FMA")
        if not w8_fits(linear):
            raise ValueError(f"input width {linear.in_features} is not a multiple of {GROUP}")
        self.out_features, self.in_features = n, k = linear.weight.shape
        q, scale, offset = quantize_groups(linear.weight)
        n_pad = -(-n // BLOCK_N) * BLOCK_N
        groups = k // GROUP
        q = _padded_rows(q, n_pad)
        # [N/2][K/8][2][8]: one 8-byte load is 8 inputs of one channel, the tile's two
        # channels side by side
        packed = q.view(n_pad // BLOCK_N, BLOCK_N, k // 8, 8).permute(0, 2, 1, 3)
        self.register_buffer("packed", packed.contiguous(), persistent=False)
        # [N/2][K/32][2]: a group's scales (offsets) for the tile's two channels side by side
        self.register_buffer("scale", _by_block(_padded_rows(scale, n_pad), groups),
                             persistent=False)
        self.register_buffer("offset", _by_block(_padded_rows(offset, n_pad), groups),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        self._args = (self.packed.data_ptr(), self.scale.data_ptr(), self.offset.data_ptr(), n,
                      0 if bias is None else bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 in, float32 out."""
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        packed, scale, offset, n, bias = self._args
        _w8_group.linear(rows.data_ptr(), rows.shape[0], self.in_features, packed, scale, offset,
                         n, bias, y.data_ptr())
        return y.view(*x.shape[:-1], self.out_features)


def _padded_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` with zero rows appended up to `n` rows (packed blocks are whole)."""
    out = torch.zeros(n, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _by_block(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, G] -> [N/2][G][2], contiguous."""
    return t.view(-1, BLOCK_N, groups).permute(0, 2, 1).contiguous()
