"""The native decode attention (native/linear/paged_decode.c) against a plain torch statement.

The kernel splits a row's context into 64-token spans and merges their parts; it shares a KV
head's loads among its query heads three at a time and scores four tokens at once. Each shape
below takes a different one of those paths; a row's result must not depend on its batch.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_server.engine.w8_linear import w8_supported

try:
    from mooncake_server.engine import _paged_decode  # type: ignore[attr-defined]
except ImportError:  # built only on x86-64
    _paged_decode = None

pytestmark = pytest.mark.skipif(_paged_decode is None or not w8_supported(),
                                reason="the native decode attention needs x86-64 with AVX2+FMA")

LAYERS = 2


def _pool(blocks: int, kv_heads: int, bt: int, d: int, seed: int) -> torch.Tensor:
    """A random pool laid out as the engine's: [blocks, layers, K|V, kv_heads, bt, d]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, LAYERS, 2, kv_heads, bt, d, generator=g)


def _native(pool: torch.Tensor, tables: list[list[int]], lens: list[int], q: torch.Tensor,
            layer: int, scale: float) -> torch.Tensor:
    """Decode attention for rows q [rows, heads, d] in one kernel call."""
    rows, heads, d = q.shape
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long)
    n = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty(rows, heads, d)
    _paged_decode.decode(q.data_ptr(), q.stride(0), pool.data_ptr(), table.data_ptr(), width,
                         n.data_ptr(), rows, layer, LAYERS, pool.shape[3], heads, d,
                         pool.shape[4], scale, out.data_ptr())
    return out


def _reference(pool: torch.Tensor, table: list[int], n: int, q: torch.Tensor, layer: int,
               scale: float) -> torch.Tensor:
    """softmax(scale q.K) V over one row's first n tokens, query head h on KV head h // group."""
    heads, d = q.shape
    kv = pool[table, layer].permute(1, 2, 0, 3, 4).reshape(2, pool.shape[3], -1, d)[:, :, :n]
    k, v = kv[0].double(), kv[1].double()
    group = heads // pool.shape[3]
    out = torch.empty(heads, d, dtype=torch.double)
    for h in range(heads):
        w = torch.softmax(scale * (k[h // group] @ q[h].double()), dim=0)
        out[h] = w @ v[h // group]
    return out.float()


@pytest.mark.parametrize(("heads", "kv_heads", "d", "bt"), [
    (9, 3, 64, 16),  # the bundled model: 3 query heads per KV head, 32-wide slices
    (8, 2, 16, 4),  # 4 per KV head: a pass of 3 then 1; 8-wide slices
    (4, 4, 24, 5),  # no grouping; blocks that do not divide a span
    (6, 1, 40, 16),  # 6 on one KV head; a 32-wide slice then an 8-wide one
])
def test_native_decode_matches_softmax_attention(heads: int, kv_heads: int, d: int,
                                                 bt: int) -> None:
    lens = [1, 5, 64, 65, 200, 129]
    tables, nxt = [], 0
    for n in lens:
        need = -(-n // bt)
        tables.append(list(range(nxt + need - 1, nxt - 1, -1)))  # blocks out of order
        nxt += need
    pool = _pool(nxt, kv_heads, bt, d, seed=heads * 100 + d)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(d))
    scale = d ** -0.5
    out = _native(pool, tables, lens, q, 1, scale)
    for r, n in enumerate(lens):
        torch.testing.assert_close(out[r], _reference(pool, tables[r], n, q[r], 1, scale),
                                   rtol=2e-5, atol=2e-5)
        alone = _native(pool, [tables[r]], [n], q[r:r + 1].clone(), 1, scale)
        assert torch.equal(alone[0], out[r]), f"row {r} differs alone and in its batch"
