"""Store nodes as separate processes behind the global index: replicas, failover, SSD, restart."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from store_procs import SECRET, IndexServer, StoreProc, addr_of, index_server, store_proc, until

from mooncake_server.store_client.cluster import StoreCluster, StoreUnavailable
from mooncake_server.transfer import TransferEngine, crc32c


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus text page."""
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


@dataclass
class Writer:
    """A prefill/decode-like process: its own transfer engine and buffers, a StoreCluster."""

    cluster: StoreCluster
    src: memoryview
    dst: memoryview
    block: int

    def addrs(self, buf: memoryview, idx: range) -> list[int]:
        return [addr_of(buf) + i * self.block for i in idx]

    async def put(self, keys: list[str], idx: range) -> list[bool]:
        sums = [crc32c(self.src[i * self.block:(i + 1) * self.block]) for i in idx]
        return await self.cluster.put(keys, self.addrs(self.src, idx), [self.block] * len(keys),
                                      sums)

    async def get(self, keys: list[str], idx: range) -> int:
        self.dst[:] = bytes(len(self.dst))
        return await self.cluster.get(keys, self.addrs(self.dst, idx), [self.block] * len(keys))

    def same(self, idx: range) -> bool:
        b = self.block
        return all(self.dst[i * b:(i + 1) * b] == self.src[i * b:(i + 1) * b] for i in idx)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


def make_writer(index: IndexServer, http: httpx.AsyncClient, n: int, block: int,
                engine: TransferEngine) -> Writer:
    src = engine.alloc_shared("src", n * block)
    src[:] = os.urandom(n * block)
    dst = bytearray(n * block)
    engine.register_memory("dst", dst)
    return Writer(StoreCluster(index.url, engine, http, SECRET), src, memoryview(dst), block)


async def stop_all(nodes: list[StoreProc]) -> None:
    await asyncio.gather(*(n.stop() for n in nodes))


async def test_three_nodes_two_replicas_survive_a_killed_node(http: httpx.AsyncClient) -> None:
    n, block = 1000, 4096
    async with index_server(replicas=2) as index:
        nodes = [store_proc(index.url, f"node-{i}") for i in range(3)]
        engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="tcp")
        try:
            await asyncio.gather(*(node.start() for node in nodes))
            w = make_writer(index, http, n, block, engine)
            keys = [f"block-{i:04d}" for i in range(n)]
            assert await w.put(keys, range(n)) == [True] * n
            # Every block reaches the index with 2 copies, spread over all three nodes.
            await until(lambda: index.master.index.stats().replicas == 2 * n, what="2 copies")
            by_node = index.master.index.stats().by_node
            assert sorted(by_node) == ["node-0", "node-1", "node-2"]
            assert all(count > n // 3 for count in by_node.values()), by_node

            await nodes[1].stop(signal.SIGKILL)
            # At once (the conductor has not noticed yet): reads fail over to the other copy.
            assert await w.get(keys, range(n)) == n
            assert w.same(range(n))
            # Once the registry declares it dead, the index no longer offers it at all.
            await until(lambda: "node-1" not in index.master.live_nodes(), what="node-1 dead")
            where = index.master.locate(keys)
            assert all(r and all(x.node_id != "node-1" for x in r) for r in where.replicas)
            assert await w.get(keys, range(n)) == n
            assert w.same(range(n))
            # New blocks go to the two survivors.
            more = [f"more-{i}" for i in range(10)]
            assert await w.put(more, range(10)) == [True] * 10
            assert {r.node_id for x in index.master.locate(more).replicas for r in x} <= {
                "node-0", "node-2"}
        finally:
            engine.close()
            await stop_all(nodes)


async def test_put_without_any_live_node_is_a_clear_error(http: httpx.AsyncClient) -> None:
    async with index_server(replicas=2) as index:
        engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="tcp")
        try:
            w = make_writer(index, http, 1, 64, engine)
            with pytest.raises(StoreUnavailable, match="no live store node"):
                await w.put(["k"], range(1))
            assert await w.get(["k"], range(1)) == 0
        finally:
            engine.close()


async def test_ssd_demote_rehydrate_and_restart_keep_identical_bytes(
        http: httpx.AsyncClient, tmp_path: object) -> None:
    n, block = 48, 64 << 10  # 3 MiB of blocks into a 1 MiB DRAM pool
    ssd = f"{tmp_path}/ssd"
    extra = ["--ssd-dir", ssd, "--ssd-capacity", "64MiB", "--demote-after", "0.3"]
    async with index_server(replicas=1) as index:
        node = store_proc(index.url, "ssd-node", memory="1MiB", extra=extra)
        engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="tcp")
        try:
            await node.start()
            w = make_writer(index, http, n, block, engine)
            keys = [f"ssd-{i:03d}" for i in range(n)]
            # One put cannot exceed DRAM (its reservations are pinned), so write 8 at a time;
            # earlier blocks leave DRAM by LRU, which demotes them to SSD.
            for start in range(0, n, 8):
                assert await w.put(keys[start:start + 8], range(start, start + 8)) == [True] * 8
            text = await node.metrics()
            assert metric(text, "mooncake_store_demotions_total") > 0
            assert metric(text, "mooncake_store_objects", '{tier="ssd"}') > 0
            # Read back in groups that fit in DRAM: SSD-only blocks are rehydrated, same bytes.
            for start in range(0, n, 8):
                idx = range(start, start + 8)
                assert await w.get(keys[start:start + 8], idx) == 8
                assert w.same(idx)
            text = await node.metrics()
            assert metric(text, "mooncake_store_rehydrations_total") > 0
            assert metric(text, "mooncake_store_hits_total", '{tier="ssd"}') > 0

            # Idle blocks all move to SSD; then a crash (SIGKILL) and a restart keep them.
            async def all_on_ssd() -> bool:
                t = await node.metrics()
                return (metric(t, "mooncake_store_objects", '{tier="dram"}') == 0
                        and metric(t, "mooncake_store_ssd_pending_bytes") == 0)
            await until(all_on_ssd, what="idle demotion")
            await node.stop(signal.SIGKILL)
            restarted = store_proc(index.url, "ssd-node", memory="1MiB", extra=extra,
                                   port=node.port)
            node = restarted
            await node.start()
            # The restarted node re-reports its SSD tier to the global index.
            await until(lambda: index.master.index.stats().by_tier["ssd"] == n,
                        what="SSD snapshot in the index")
            for start in range(0, n, 8):
                idx = range(start, start + 8)
                assert await w.get(keys[start:start + 8], idx) == 8
                assert w.same(idx)
        finally:
            engine.close()
            await node.stop()


async def test_hot_blocks_gain_replicas_copied_between_nodes(http: httpx.AsyncClient) -> None:
    n, block = 8, 8192
    async with index_server(replicas=1, hot_threshold=3) as index:
        nodes = [store_proc(index.url, f"hot-{i}") for i in range(3)]
        engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="tcp")
        try:
            await asyncio.gather(*(node.start() for node in nodes))
            w = make_writer(index, http, n, block, engine)
            keys = [f"system-prompt-{i}" for i in range(n)]
            assert all(await w.put(keys, range(n)))
            await until(lambda: index.master.index.stats().replicas == n, what="indexed")
            master = index.master
            master.note_hits(keys[:4])
            assert master.hot_plan(keys) == []  # below the threshold: nothing to copy
            for _ in range(2):
                master.note_hits(keys[:4])
            assert await master.replicate_hot(keys, http) == 4 * 2  # 4 hot keys, 2 more nodes
            await until(lambda: all(len(master.index.replicas(k, master.live_nodes())) == 3
                                    for k in keys[:4]), what="hot keys on every node")
            assert all(len(master.index.replicas(k, master.live_nodes())) == 1 for k in keys[4:])
            # Every copy holds the same bytes: kill the original holders one by one and read.
            for victim in nodes[:2]:
                await victim.stop()
                assert await w.get(keys[:4], range(4)) == 4
                assert w.same(range(4))
        finally:
            engine.close()
            await stop_all(nodes)


async def test_tcp_reads_go_by_key_in_one_round_trip(http: httpx.AsyncClient) -> None:
    n, block = 8, 256 << 10
    async with index_server(replicas=1) as index:
        node = store_proc(index.url, "by-key")
        engine = TransferEngine(secret=SECRET.encode(), serve=False, transport="tcp")
        try:
            await node.start()
            w = make_writer(index, http, n, block, engine)
            keys = [f"bk-{i}" for i in range(n)]
            assert await w.put(keys, range(n)) == [True] * n
            assert await w.get(keys, range(n)) == n
            assert w.same(range(n))
            text = await node.metrics()
            # Served by the node's engine without a lease, and counted as DRAM hits.
            assert metric(text, "mooncake_store_gets_by_key_total") == n
            assert metric(text, "mooncake_store_hits_total", '{tier="dram"}') == n
            # A removed key is no longer served by key; the lease path confirms the miss.
            await w.cluster.remove(keys[:1])
            assert await w.get(keys, range(n)) == 0
            assert await w.get(keys[1:], range(1, n)) == n - 1
            assert metric(await node.metrics(), "mooncake_store_draining_bytes") == 0
        finally:
            engine.close()
            await node.stop()
