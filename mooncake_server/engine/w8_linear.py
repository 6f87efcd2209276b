"""A weight-only int8 linear on AVX2+FMA CPUs (native/linear/w8_group.c): `--dtype auto`'s kernel.

Weights are bytes in groups of 32 inputs, each group with its own scale and offset (w = s*q + m);
activations stay float32 and are multiplied in float32. Decode steps read a quarter of float32's
weight bytes, and the only rounding against the float32 mode is the weights', which for a model
converted from a Q4_1/Q8_0 GGUF (the bundled default) is one float32 rounding: its levels land
on exact byte levels. Every output is summed in one fixed order, so a row's result
does not depend on the other rows of its call, the thread count, or which AVX2 CPU runs it.

A linear whose every group is exactly s * n + m with n in 0..15 (a Q4_1 GGUF's blocks, as
transformers dequantizes them) is kept in 4 bits instead: half the bytes a decode step reads,
and the kernel multiplies by the model's float32 weights themselves, bit for bit.
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


def four_bit_groups(weight: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(levels 0..15 uint8 [N, K], scale [N, K/32], offset [N, K/32]) with every weight exactly
    fma(level, scale, offset) in float32, or None where a group has no such form.

    A Q4_1 block's minimum sits on level 0 (the offset is the group's minimum) and its maximum on
    the top level used, most often 15; the scale is that range over the top level, as float32
    or as the GGUF's float16.
    """
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    levels = torch.zeros(w.shape, dtype=torch.uint8)
    scale = torch.zeros(lo.shape)
    todo = torch.ones(lo.shape, dtype=torch.bool)
    for top in range(15, 0, -1):
        for step in ((hi - lo) / top, ((hi - lo) / top).half().float()):
            idx = todo.nonzero(as_tuple=True)
            if not idx[0].numel():
                return levels.view(n, k), scale, lo
            wt, lt, st = w[idx], lo[idx], step[idx]
            q = torch.round((wt - lt[:, None]) / torch.where(st > 0, st, 1.0)[:, None])
            q = q.clamp(0, 15)
            # In float64, q * s + m is exact (checked), so its rounding to float32 is the
            # kernel's fma's.
            rec = (q.double() * st.double()[:, None] + lt.double()[:, None]).float()
            good = (rec == wt).all(dim=-1) & _exact_in_double(wt, st, lt)
            hit = tuple(i[good] for i in idx)
            levels[hit] = q[good].to(torch.uint8)
            scale[hit] = st[good]
            todo[hit] = False
        if top == 15 and not _at_most_16_values(w[todo.nonzero(as_tuple=True)]):
            return None  # no grid of 16 levels holds these groups (int8 GGUF tensors)
    return (levels.view(n, k), scale, lo) if not todo.any() else None


def _at_most_16_values(groups: torch.Tensor) -> bool:
    """Every group (row) holds at most 16 distinct values."""
    if not groups.numel():
        return True
    ordered = groups.sort(dim=-1).values
    return bool(((ordered[:, 1:] != ordered[:, :-1]).sum(dim=-1) < 16).all())


def _exact_in_double(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Per group: level * scale + offset needs at most 53 bits for each of its weights (so
    float64 holds it exactly): the largest weight over the finer of the two terms' last bits."""
    def last_bit(x: torch.Tensor) -> torch.Tensor:
        e = torch.frexp(x)[1].double() - 24  # float32: 24 bits of mantissa
        return torch.where(x != 0, e, torch.full_like(e, 1e9))

    top = torch.frexp(w.abs().amax(dim=-1))[1].double()
    return top - torch.minimum(last_bit(scale), last_bit(offset)) + 1 <= 53


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight the kernel multiplies by (for quality checks in torch)."""
    if four_bit_groups(weight) is not None:
        return weight.detach().float().clone()
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
        four = four_bit_groups(linear.weight)
        self.bits = 8 if four is None else 4
        q, scale, offset = quantize_groups(linear.weight) if four is None else four
        n_pad = -(-n // BLOCK_N) * BLOCK_N
        groups = k // GROUP
        q = _padded_rows(q, n_pad)
        if four is None:
            # [N/2][K/8][2][8]: one 8-byte load is 8 inputs of one channel, the tile's two
            # channels side by side
            packed = q.view(n_pad // BLOCK_N, BLOCK_N, k // 8, 8).permute(0, 2, 1, 3)
        else:
            # [N/2][K/16][2][8]: byte j of a channel's 8 holds input j (low nibble) and j + 8
            halves = q.view(n_pad // BLOCK_N, BLOCK_N, k // 16, 2, 8)
            packed = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 1, 3)
        self.register_buffer("packed", packed.contiguous(), persistent=False)
        # [N/2][K/32][2]: a group's scales (offsets) for the tile's two channels side by side
        self.register_buffer("scale", _by_block(_padded_rows(scale, n_pad), groups),
                             persistent=False)
        self.register_buffer("offset", _by_block(_padded_rows(offset, n_pad), groups),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        self._args = (self.packed.data_ptr(), self.scale.data_ptr(), self.offset.data_ptr(), n,
                      0 if bias is None else bias.data_ptr(), self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 in, float32 out."""
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        packed, scale, offset, n, bias, bits = self._args
        _w8_group.linear(rows.data_ptr(), rows.shape[0], self.in_features, packed, scale, offset,
                         n, bias, y.data_ptr(), bits, 0)
        return y.view(*x.shape[:-1], self.out_features)

    def add_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += self(x), in place and with the same bits as `residual + self(x)`
        (residual: contiguous float32 [rows, out_features])."""
        rows = x.reshape(-1, self.in_features).contiguous()
        assert residual.is_contiguous() and residual.shape == (rows.shape[0], self.out_features)
        packed, scale, offset, n, bias, bits = self._args
        _w8_group.linear(rows.data_ptr(), rows.shape[0], self.in_features, packed, scale, offset,
                         n, bias, residual.data_ptr(), bits, 1)
        return residual


def _padded_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` with zero rows appended up to `n` rows (packed blocks are whole)."""
    out = torch.zeros(n, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _by_block(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, G] -> [N/2][G][2], contiguous."""
    return t.view(-1, BLOCK_N, groups).permute(0, 2, 1).contiguous()
