"""Replaying the Mooncake synthetic trace's block keys through the real store role.

Each request does what prefill does: get (lease) the longest cached prefix of its chained keys,
then put the rest. Keys only, 64-byte values. With unbounded capacity the hit ratio must be the
trace's ideal (every repeated block is a prefix hit); with room for C blocks it must equal, hit
for hit, an independent LRU simulation of a prefix cache over the same key sequence.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from store_procs import SECRET, addr_of, index_server

from mooncake_server.config import ServerConfig
from mooncake_server.roles.store.app import build_app
from mooncake_server.store_client.client import StoreClient
from mooncake_server.transfer import TransferEngine, crc32c

# The paper's synthetic trace, shipped with the repository (traces/README.md).
TRACE = Path(__file__).resolve().parents[2] / "traces" / "synthetic_trace.jsonl"
VALUE = 64  # bytes per block: keys are what is under test
CAPACITY_BLOCKS = 2000  # > the longest request (374 blocks), < the 43,924 distinct blocks


def load_trace() -> list[list[str]]:
    """Per request, its block keys (hash ids are chained: equal ids = equal prefix)."""
    with TRACE.open() as f:
        return [[f"h{h}" for h in json.loads(line)["hash_ids"]] for line in f if line.strip()]


def reference_prefix_lru(requests: list[list[str]], capacity: int | None) -> int:
    """Prefix hits of an LRU prefix cache holding `capacity` blocks (None = unbounded)."""
    lru: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for keys in requests:
        h = 0
        while h < len(keys) and keys[h] in lru:
            h += 1
        hits += h
        for key in keys:  # reused prefix, then the rest, each becomes most recently used
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                if capacity is not None and len(lru) > capacity:
                    lru.popitem(last=False)
    return hits


class Replayer:
    """A prefill-like client of one real store node (control over ASGI, bytes over shm)."""

    def __init__(self, client: StoreClient, engine: TransferEngine, longest: int) -> None:
        self.client = client
        self.buf = engine.alloc_shared("replay", longest * VALUE)
        for i in range(longest):
            self.buf[i * VALUE:(i + 1) * VALUE] = i.to_bytes(4, "little") * (VALUE // 4)
        base = addr_of(self.buf)
        self.addrs = [base + i * VALUE for i in range(longest)]
        self.sums = [crc32c(self.buf[i * VALUE:(i + 1) * VALUE]) for i in range(longest)]

    async def request(self, keys: list[str]) -> int:
        """Prefix hits of one request; the missed blocks are then stored."""
        n = len(keys)
        hit = await self.client.get(keys, self.addrs[:n], [VALUE] * n)
        await self.client.settle()  # the lease is released before the rest is written
        rest = keys[hit:]
        if rest:
            stored = await self.client.put(rest, self.addrs[hit:n], [VALUE] * len(rest),
                                           self.sums[hit:n])
            assert all(stored), "the store refused a block: eviction should have made room"
        return hit


@pytest.fixture
async def index_url() -> AsyncIterator[str]:
    async with index_server(replicas=1) as index:
        yield index.url


async def replay(index_url: str, requests: list[list[str]], capacity: int | None) -> int:
    """Run the requests through a fresh store role; return its prefix hits."""
    longest = max(len(k) for k in requests)
    blocks = capacity if capacity is not None else sum(len(k) for k in requests)
    config = ServerConfig(role="store", conductor_url=index_url, cluster_secret=SECRET,
                          store_memory_bytes=blocks * VALUE, store_high_watermark=1.0,
                          instance_id=f"replay-{capacity}", transport="shm")
    app = build_app(config)
    engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="shm")
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=config.base_url) as http:
                runtime = app.state.store
                replayer = Replayer(StoreClient(runtime.location, engine, http, SECRET), engine,
                                    longest)
                hits = 0
                for keys in requests:
                    hits += await replayer.request(keys)
                stats = runtime.node.stats()
                assert stats.active_leases == 0 and stats.writing == 0
                if capacity is not None:
                    assert stats.dram_objects == capacity  # full, and never over
                return hits
    finally:
        engine.close()


async def test_unbounded_store_hits_the_traces_ideal_ratio(index_url: str) -> None:
    requests = load_trace()
    total = sum(len(k) for k in requests)
    started = time.perf_counter()
    hits = await replay(index_url, requests, capacity=None)
    assert hits == reference_prefix_lru(requests, None)
    assert round(hits / total, 2) == 0.64  # the trace's README: 64% of blocks repeat
    assert time.perf_counter() - started < 60


async def test_bounded_store_equals_a_reference_lru_exactly(index_url: str) -> None:
    requests = load_trace()
    hits = await replay(index_url, requests, capacity=CAPACITY_BLOCKS)
    expected = reference_prefix_lru(requests, CAPACITY_BLOCKS)
    assert hits == expected
    assert 0 < expected < reference_prefix_lru(requests, None)  # the bound really bites
