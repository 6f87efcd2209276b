"""The default mode's native layer steps (rope, SiLU-and-mul, the residual added by the output
projection) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncake_server.engine.row_ops import rope_, rope_fits, row_ops_built, silu_mul
from mooncake_server.engine.w8_linear import W8Linear, w8_supported

pytestmark = pytest.mark.skipif(not (row_ops_built() and w8_supported()),
                                reason="the native layer steps need x86-64 with AVX2+FMA")


@pytest.mark.parametrize(("rows", "d"), [(1, 64), (37, 16), (5, 128)])
def test_rope_in_place_has_torchs_bits(rows: int, d: int) -> None:
    """q and k heads rotate in place exactly as llama_stack's torch statement; v is untouched."""
    g = torch.Generator().manual_seed(d)
    heads, kv_heads = 6, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(rows, 1, d, generator=g), torch.randn(rows, 1, d, generator=g)
    rotated = heads + kv_heads
    qk = qkv[:, :rotated * d].view(rows, rotated, d)
    half = d // 2
    expected = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
    v = qkv[:, rotated * d:].clone()
    rope_(qkv, rotated, cos, sin)
    assert torch.equal(qkv[:, :rotated * d].view(rows, rotated, d), expected)
    assert torch.equal(qkv[:, rotated * d:], v)
    assert rope_fits(64) and not rope_fits(12)


def test_silu_mul_matches_torch_and_each_row_stands_alone() -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = torch.cat([torch.randn(33, 96, generator=g) * 6,
                         torch.tensor([[-100.0, 100.0, 0.0, -0.0, 88.0, -88.0, 1e-30, -1e-30] * 6
                                       + [1.0] * 48])])
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    assert torch.isfinite(out).all()
    for r in (0, 17, 33):
        assert torch.equal(silu_mul(gate_up[r:r + 1].clone())[0], out[r])


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_linear_adds_into_the_residual_with_torchs_bits(rows: int) -> None:
    """`add_into` gives the bits of `residual + linear(x)`, in place, on both kernel paths."""
    torch.manual_seed(rows)
    lin = W8Linear(torch.nn.Linear(64, 40))
    x, residual = torch.randn(rows, 64), torch.randn(rows, 40)
    expected = residual + lin(x)
    out = lin.add_into(x, residual)
    assert out is residual and torch.equal(residual, expected)
