"""The cache simulator against a live store node: the same trace, the same hits per request."""

from __future__ import annotations

import os

import httpx
from store_procs import SECRET, addr_of, index_server, store_proc, until

from mooncake_bench.cache_sim import BLOCK_BYTES, request_keys, simulate
from mooncake_bench.trace import DEFAULT_TRACE, load_trace
from mooncake_server.store_client.client import StoreClient
from mooncake_server.transfer import TransferEngine, crc32c

CAPACITY_BLOCKS = 64  # small enough that the trace slice evicts
MAX_BLOCKS = 24  # a request's blocks, at most (the slice's long prompts cut)


def trace_slice(n: int) -> list[tuple[int, ...]]:
    """The first `n` requests of the shipped sample, their hash ids cut to MAX_BLOCKS."""
    return [r.hash_ids[:MAX_BLOCKS] for r in load_trace(DEFAULT_TRACE, 0, n)]


async def test_the_simulator_sees_the_hits_a_live_store_node_gives() -> None:
    """Each request reads the leading blocks the node holds, then writes the rest: the node's
    own table, driven over HTTP and the transfer engine, and the simulator, driven in memory,
    evict the same blocks and so answer the same hits, request by request."""
    requests = trace_slice(120)
    sim = simulate(requests, CAPACITY_BLOCKS, mode="global", nodes=1)
    assert 0 < sim.hits < sim.blocks  # the slice both reuses and evicts

    live: list[int] = []
    async with index_server(replicas=1) as index, httpx.AsyncClient(timeout=10.0) as http:
        node = store_proc(index.url, "node-0", memory=f"{CAPACITY_BLOCKS * BLOCK_BYTES}")
        engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="tcp")
        try:
            await node.start()
            await until(lambda: index.master.live_nodes(), what="the node registered")
            client = StoreClient(next(iter(index.master.live_nodes().values())), engine, http,
                                 SECRET)
            src = engine.alloc_shared("src", MAX_BLOCKS * BLOCK_BYTES)
            src[:] = os.urandom(len(src))
            dst = bytearray(MAX_BLOCKS * BLOCK_BYTES)
            engine.register_memory("dst", dst)
            sums = [crc32c(src[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]) for i in range(MAX_BLOCKS)]

            def addrs(buf: memoryview | bytearray, n: int) -> list[int]:
                return [addr_of(buf) + i * BLOCK_BYTES for i in range(n)]

            for hash_ids in requests:
                keys = request_keys(hash_ids)
                hit = await client.get(keys, addrs(dst, len(keys)), [BLOCK_BYTES] * len(keys))
                await client.settle()  # its lease is released before the next write
                new = keys[hit:]
                await client.put(new, addrs(src, len(new)), [BLOCK_BYTES] * len(new),
                                 sums[:len(new)])
                live.append(hit)
            await client.aclose()
        finally:
            engine.close()
            await node.stop()
    assert live == sim.per_request
