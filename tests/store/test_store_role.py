"""The store role end to end in one process: HTTP control plane + real transfer engine + client."""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI

from mooncake_server.config import ServerConfig
from mooncake_server.roles.store.app import StoreRuntime, build_app
from mooncake_server.store_client.client import ChecksumError, StoreClient, StoreError
from mooncake_server.transfer import TransferEngine, _native, crc32c
from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_server.wire.index import StoreReport, StoreReportReply
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_testkit.in_process import serve_app

SECRET = "store-test-secret"
BLOCK = 10_000  # deliberately not a multiple of the store's 64-byte alignment
N_BLOCKS = 50


@dataclass
class ConductorStub:
    """Records what the store tells a conductor."""

    url: str = ""
    registered: list[InstanceInfo] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    reports: list[StoreReport] = field(default_factory=list)


@pytest.fixture
async def conductor() -> AsyncIterator[ConductorStub]:
    """A minimal conductor on 127.0.0.1 (random port) accepting register + heartbeat."""
    stub = ConductorStub()
    app = FastAPI()

    @app.post("/internal/register")
    async def register(info: InstanceInfo) -> dict[str, bool]:
        stub.registered.append(info)
        return {"ok": True}

    @app.post("/internal/heartbeat")
    async def heartbeat(beat: Heartbeat) -> dict[str, bool]:
        stub.heartbeats.append(beat)
        return {"ok": True}

    @app.post("/internal/store/report")
    async def report(body: StoreReport) -> StoreReportReply:
        stub.reports.append(body)
        return StoreReportReply(accepted=True)

    async with serve_app(app) as stub.url:
        yield stub


@dataclass
class StoreHarness:
    """A running store app and what a test needs to poke at it."""

    app: FastAPI
    http: httpx.AsyncClient

    @property
    def runtime(self) -> StoreRuntime:
        return self.app.state.store


@pytest.fixture
async def store(conductor: ConductorStub) -> AsyncIterator[StoreHarness]:
    """The store role with an 8 MiB pool; HTTP goes through ASGI, bytes through the engine."""
    config = ServerConfig(role="store", conductor_url=conductor.url, cluster_secret=SECRET,
                          store_memory_bytes=8 << 20, heartbeat_interval_s=0.05,
                          instance_id="store-under-test", transfer_timeout_s=5.0)
    app = build_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=config.base_url) as http:
            yield StoreHarness(app, http)


@dataclass
class Side:
    """A client engine with a source and a destination buffer registered in it."""

    engine: TransferEngine
    client: StoreClient
    src: memoryview
    dst: memoryview

    def addr(self, buf: memoryview, i: int, size: int = BLOCK) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf)) + i * size


@pytest.fixture(params=["shm", "tcp"])
async def side(request: pytest.FixtureRequest, store: StoreHarness) -> AsyncIterator[Side]:
    """A prefill/decode-like client using the given transport to reach the store."""
    engine = TransferEngine(secret=SECRET.encode(), listen_host="127.0.0.1", serve=False,
                            transport=request.param, timeout_s=5.0)
    try:
        src = engine.alloc_shared("src", N_BLOCKS * BLOCK)
        src[:] = os.urandom(len(src))
        dst_bytes = bytearray(N_BLOCKS * BLOCK)
        engine.register_memory("dst", dst_bytes)
        client = StoreClient(store.runtime.location, engine, store.http, SECRET)
        loc = store.runtime.location
        probe = await engine.open_segment_async(loc.transfer_address, loc.segment)
        assert engine.transport_of(probe) == request.param  # the path under test is the real one
        yield Side(engine, client, src, memoryview(dst_bytes))
    finally:
        engine.close()


def keys_for(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(n)]


async def put_blocks(side: Side, keys: list[str], first: int = 0) -> list[bool]:
    idx = range(first, first + len(keys))
    addrs = [side.addr(side.src, i) for i in idx]
    sums = [crc32c(side.src[i * BLOCK:(i + 1) * BLOCK]) for i in idx]
    return await side.client.put(keys, addrs, [BLOCK] * len(keys), sums)


async def get_blocks(side: Side, keys: list[str]) -> int:
    addrs = [side.addr(side.dst, i) for i in range(len(keys))]
    return await side.client.get(keys, addrs, [BLOCK] * len(keys))


async def test_put_then_get_moves_the_exact_bytes(
        side: Side, store: StoreHarness, conductor: ConductorStub) -> None:
    keys = keys_for(N_BLOCKS)
    assert await put_blocks(side, keys) == [True] * N_BLOCKS
    assert await side.client.prefix_hits(keys + ["absent"]) == N_BLOCKS
    assert await get_blocks(side, keys) == N_BLOCKS
    assert bytes(side.dst) == bytes(side.src)
    for i in range(N_BLOCKS):
        block = side.dst[i * BLOCK:(i + 1) * BLOCK]
        assert crc32c(block) == store.runtime.table.lookup(keys[i]).checksum  # type: ignore[union-attr]
    await side.client.settle()
    assert store.runtime.table.stats().active_leases == 0  # get released its lease

    # A second put of the same keys is a no-op that still reports them as stored.
    used = store.runtime.table.stats().bytes_used
    assert await put_blocks(side, keys) == [True] * N_BLOCKS
    assert store.runtime.table.stats().bytes_used == used

    # The store registered itself with what a peer needs to reach its pool, and heartbeats.
    info = conductor.registered[0]
    assert (info.role, info.segment) == ("store", store.runtime.location.segment)
    assert info.transfer_address == store.runtime.engine.address
    await _until(lambda: len(conductor.heartbeats) >= 1)
    # ... and reported the committed keys to the global index (a snapshot, then deltas).
    await _until(lambda: {e.key for r in conductor.reports for e in r.entries
                          if e.tier == "dram"} >= set(keys))
    assert conductor.reports[0].snapshot


async def test_a_node_without_a_control_channel_is_reached_over_http(
        side: Side, store: StoreHarness) -> None:
    """Clients of a node that advertises no binary channel fall back to its HTTP routes."""
    assert store.runtime.location.control_address  # the channel is the normal path
    http_only = store.runtime.location.model_copy(update={"control_address": None})
    side.client = StoreClient(http_only, side.engine, store.http, SECRET)
    keys = keys_for(4, "http")
    assert await put_blocks(side, keys) == [True] * 4
    assert await side.client.prefix_hits(keys) == 4
    assert await get_blocks(side, keys) == 4
    assert bytes(side.dst[:4 * BLOCK]) == bytes(side.src[:4 * BLOCK])
    await side.client.settle()
    assert store.runtime.table.stats().active_leases == 0
    await side.client.remove(keys)
    assert await side.client.prefix_hits(keys) == 0


async def test_corrupted_block_raises_checksum_error(side: Side, store: StoreHarness) -> None:
    keys = keys_for(5)
    assert all(await put_blocks(side, keys))
    victim = store.runtime.table.lookup(keys[3])
    assert victim is not None
    store.runtime.pool[victim.offset + 17] ^= 0xFF
    with pytest.raises(ChecksumError) as err:
        await get_blocks(side, keys)
    assert err.value.key == keys[3] and keys[3] in str(err.value)
    await side.client.settle()
    assert store.runtime.table.stats().active_leases == 0  # released on the error path too


async def test_get_verifies_with_the_engines_checksums_not_a_second_pass(
        side: Side, store: StoreHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    # the transfer engine checksums each block as it lands: the client never re-reads the bytes
    def second_pass(*args: object) -> object:
        raise AssertionError("get re-read the blocks to checksum them")

    keys = keys_for(12)
    assert all(await put_blocks(side, keys))
    for name in ("crc32c", "crc32c_addr", "crc32c_many"):  # every CRC Python can ask for
        monkeypatch.setattr(_native, name, second_pass)
    assert await get_blocks(side, keys) == 12
    assert bytes(side.dst[:12 * BLOCK]) == bytes(side.src[:12 * BLOCK])
    victim = store.runtime.table.lookup(keys[7])
    assert victim is not None
    store.runtime.pool[victim.offset + BLOCK - 1] ^= 0x01  # the very last byte of the block
    with pytest.raises(ChecksumError) as err:
        await get_blocks(side, keys)
    assert err.value.key == keys[7]


async def test_get_stops_at_first_missing_key(side: Side) -> None:
    keys = keys_for(6)
    assert all(await put_blocks(side, keys[:3]))
    assert all(await put_blocks(side, keys[4:], first=4))
    assert await side.client.prefix_hits(keys) == 3
    assert await get_blocks(side, keys) == 3
    assert bytes(side.dst[:3 * BLOCK]) == bytes(side.src[:3 * BLOCK])
    assert await get_blocks(side, ["nothing-here"]) == 0


async def test_remove_makes_keys_absent(side: Side, store: StoreHarness) -> None:
    keys = keys_for(4)
    assert all(await put_blocks(side, keys))
    await side.client.remove(keys[:2])
    assert await side.client.prefix_hits(keys) == 0
    assert await side.client.prefix_hits(keys[2:]) == 2
    assert store.runtime.table.stats().bytes_used == 2 * ((BLOCK + 63) // 64 * 64)


async def test_refused_put_reports_false(side: Side, store: StoreHarness) -> None:
    big = 9 << 20  # larger than the whole 8 MiB pool
    buf = bytearray(big)
    side.engine.register_memory("big", buf)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert await side.client.put(["huge", "small"], [addr, addr], [big, 64],
                                 [crc32c(buf), crc32c(bytes(64))]) == [False, True]
    assert store.runtime.table.stats().puts_refused == 1


async def test_failed_put_aborts_the_reservation(side: Side, store: StoreHarness) -> None:
    # A caller bug (a local address the engine does not know) surfaces as is, after the abort.
    unregistered = ctypes.create_string_buffer(BLOCK)
    with pytest.raises(ValueError, match="registered"):
        await side.client.put(["x"], [ctypes.addressof(unregistered)], [BLOCK], [0])
    assert store.runtime.table.stats().writing == 0
    # The store's transfer engine going away is a StoreError, and the reservation is freed too.
    store.runtime.engine.close()
    fresh = StoreClient(store.runtime.location, side.engine, store.http, SECRET)
    with pytest.raises(StoreError, match="store-under-test"):
        await fresh.put(["y"], [side.addr(side.src, 0)], [BLOCK], [0])
    stats = store.runtime.table.stats()
    assert stats.bytes_used == 0 and stats.writing == 0
    assert await side.client.prefix_hits(["x", "y"]) == 0


async def test_metrics_expose_counts(side: Side, store: StoreHarness) -> None:
    keys = keys_for(10)
    assert all(await put_blocks(side, keys))
    assert await get_blocks(side, keys[:4] + ["missing"]) == 4
    await side.client.settle()
    text = (await store.http.get("/metrics")).text
    assert 'mooncake_store_objects{tier="dram"} 10.0' in text
    assert 'mooncake_store_objects{tier="ssd"} 0.0' in text
    assert 'mooncake_store_hits_total{tier="dram"} 4.0' in text
    assert 'mooncake_store_hits_total{tier="ssd"} 0.0' in text
    assert "mooncake_store_misses_total 1.0" in text
    assert "mooncake_store_active_leases 0.0" in text
    assert 'mooncake_store_capacity_bytes{tier="dram"} 8.388608e+06' in text
    assert 'mooncake_store_bytes{tier="dram"} 100480.0' in text  # 10 x 10,000 B, 64-aligned
    assert 'mooncake_store_evictions_total{tier="dram"} 0.0' in text
    for name in ("demotions", "rehydrations", "puts_refused"):
        assert f"mooncake_store_{name}_total 0.0" in text


async def test_internal_endpoints_need_the_secret(store: StoreHarness) -> None:
    r = await store.http.post("/store/exists", json={"keys": ["a"]})
    assert r.status_code == 401
    r = await store.http.post("/store/exists", json={"keys": ["a"]},
                              headers={SECRET_HEADER: "wrong"})
    assert r.status_code == 401
    ok = await store.http.post("/store/exists", json={"keys": ["a"]},
                               headers={SECRET_HEADER: SECRET})
    assert ok.json() == {"exists": [False], "prefix": 0}
    health = await store.http.get("/health")
    assert health.json()["segment"] == store.runtime.location.segment


async def test_inconsistent_requests_get_400(store: StoreHarness) -> None:
    r = await store.http.post("/store/put_start", json={"keys": ["a", "b"], "sizes": [64]},
                              headers={SECRET_HEADER: SECRET})
    assert r.status_code == 400 and "sizes" in r.text


async def test_exists_of_256_keys_is_fast_server_side(store: StoreHarness) -> None:
    keys = [f"{i:032x}" for i in range(256)]
    table = store.runtime.table
    start = time.perf_counter()
    for _ in range(50):
        table.exists(keys)
    assert (time.perf_counter() - start) / 50 < 1e-3


async def _until(predicate: object, timeout_s: float = 5.0) -> None:
    """Poll `predicate` until true or fail after a deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)
