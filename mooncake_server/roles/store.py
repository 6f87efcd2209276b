"""The store role: one DRAM pool per node, served over the transfer engine, steered over HTTP.

Start-up (lifespan): transfer engine -> shared-memory pool registered as a segment -> object table
-> registration with the conductor (then heartbeats) -> lease / write-timeout reaper.
A block walks: put_start (WRITING, space reserved) -> the writer's one-sided WRITEs -> put_end
(READY) -> get (leased, pinned) -> the reader's one-sided READs -> release -> LRU eviction or remove.
Every endpoint here only moves metadata; bytes never pass through this process's Python code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake_server.config import ServerConfig
from mooncake_server.internal_http import metrics_response, require_secret
from mooncake_server.messages import (
    InstanceInfo,
    StoreExistsReply,
    StoreGet,
    StoreGetReply,
    StoreKeys,
    StoreLocation,
    StorePutEnd,
    StorePutEndReply,
    StorePutStart,
    StorePutStartReply,
    StoreRelease,
    StoreReleaseReply,
    StoreRemoveReply,
)
from mooncake_server.registry import Registrar
from mooncake_server.roles import common
from mooncake_server.store.objects import ObjectTable
from mooncake_server.transfer import TransferEngine

logger = logging.getLogger(__name__)

# Segment names are per transfer engine, so one fixed name per store node is enough.
SEGMENT_NAME = "mooncake-store-pool"
# How often expired leases and abandoned write reservations are reaped (they are also reaped
# lazily on every put_start / get, so this only bounds how long an idle store holds them).
_REAP_INTERVAL_S = 1.0


@dataclass
class StoreRuntime:
    """What the store role holds while it runs (set by the lifespan, read by the routes)."""

    engine: TransferEngine
    pool: memoryview
    table: ObjectTable
    location: StoreLocation


class _TableCollector(Collector):
    """Reads the object table's counters at scrape time, so there is one source of truth."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        runtime: StoreRuntime | None = getattr(self._app.state, "store", None)
        if runtime is None:
            return
        s = runtime.table.stats()
        gauges = [
            ("mooncake_store_objects", "READY objects in the pool", s.objects),
            ("mooncake_store_writing_objects", "objects reserved and being written", s.writing),
            ("mooncake_store_bytes_used", "bytes of the pool in use (aligned)", s.bytes_used),
            ("mooncake_store_bytes_capacity", "bytes of the pool", s.capacity),
            ("mooncake_store_largest_free_bytes", "largest free extent", s.largest_free),
            ("mooncake_store_active_leases", "gets whose blocks are still pinned", s.active_leases),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("mooncake_store_hits", "keys found by get", s.hits),
            ("mooncake_store_misses", "keys asked for by get and not found", s.misses),
            ("mooncake_store_evictions", "objects evicted by LRU", s.evictions),
            ("mooncake_store_puts_refused", "keys refused by put_start for lack of space",
             s.puts_refused),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


def build_app(config: ServerConfig) -> FastAPI:
    """The store role's FastAPI app; the lifespan owns the engine, the pool and registration."""
    instance_id = common.instance_id(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = common.make_transfer_engine(config, serve=True)
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(_close_engine, engine)
            pool = engine.alloc_shared(SEGMENT_NAME, config.store_memory_bytes)
            table = ObjectTable(len(pool))
            # Peers dial the advertised host, not the (possibly wildcard) listen address.
            address = f"{config.public_host}:{engine.address.rsplit(':', 1)[1]}"
            location = StoreLocation(instance_id=instance_id, url=config.base_url,
                                     transfer_address=address, segment=SEGMENT_NAME)
            app.state.store = StoreRuntime(engine, pool, table, location)
            reaper = asyncio.create_task(_reap_forever(table), name="store-reaper")
            stack.push_async_callback(_cancel, reaper)
            if config.conductor_url:
                info = InstanceInfo(instance_id=instance_id, role="store", url=config.base_url,
                                    transfer_address=address, segment=SEGMENT_NAME)
                registrar = Registrar(config.conductor_url, info, config.cluster_secret,
                                      config.heartbeat_interval_s)
                await registrar.start()
                stack.push_async_callback(registrar.stop)
            else:
                logger.warning("no conductor URL: store %s runs unregistered", instance_id)
            logger.info("store %s up: %d bytes at segment %s via %s", instance_id, len(pool),
                        SEGMENT_NAME, address)
            yield
            logger.info("store %s shutting down", instance_id)
            app.state.store = None

    app = FastAPI(title="mooncake-server store", lifespan=lifespan)
    metrics = CollectorRegistry()
    metrics.register(_TableCollector(app))
    guard = [Depends(require_secret(config.cluster_secret))]

    def table() -> ObjectTable:
        runtime: StoreRuntime | None = getattr(app.state, "store", None)
        if runtime is None:
            raise HTTPException(status_code=503, detail="store is starting")
        return runtime.table

    # NOTE: every route is `async def` so it runs on the event loop, which serialises all table
    # access; a plain `def` route would run in a thread pool and race.

    @app.post("/store/put_start", dependencies=guard)
    async def put_start(body: StorePutStart) -> StorePutStartReply:
        with _bad_request():
            res = table().put_start(body.keys, body.sizes)
        return StorePutStartReply(offsets=res.offsets, refused=res.refused)

    @app.post("/store/put_end", dependencies=guard)
    async def put_end(body: StorePutEnd) -> StorePutEndReply:
        with _bad_request():
            return StorePutEndReply(committed=table().put_end(body.keys, body.checksums))

    @app.post("/store/put_abort", dependencies=guard)
    async def put_abort(body: StoreKeys) -> StoreRemoveReply:
        return StoreRemoveReply(removed=table().put_abort(body.keys))

    @app.post("/store/get", dependencies=guard)
    async def get(body: StoreGet) -> StoreGetReply:
        with _bad_request():
            res = table().get(body.keys, body.lease_s)
        objs = res.objects
        return StoreGetReply(lease_id=res.lease_id, found=len(objs),
                             offsets=[o.offset for o in objs], sizes=[o.size for o in objs],
                             checksums=[o.checksum or 0 for o in objs])

    @app.post("/store/release", dependencies=guard)
    async def release(body: StoreRelease) -> StoreReleaseReply:
        return StoreReleaseReply(released=table().release(body.lease_id))

    @app.post("/store/exists", dependencies=guard)
    async def exists(body: StoreKeys) -> StoreExistsReply:
        flags, prefix = table().exists(body.keys)
        return StoreExistsReply(exists=flags, prefix=prefix)

    @app.post("/store/remove", dependencies=guard)
    async def remove(body: StoreKeys) -> StoreRemoveReply:
        return StoreRemoveReply(removed=table().remove(body.keys))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        runtime: StoreRuntime | None = getattr(app.state, "store", None)
        if runtime is None:
            raise HTTPException(status_code=503, detail="store is starting")
        return {"status": "ok", "role": "store", **runtime.location.model_dump()}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return metrics_response(metrics)

    return app


@contextlib.contextmanager
def _bad_request() -> Iterator[None]:
    """Turn the table's ValueError (inconsistent request) into HTTP 400."""
    try:
        yield
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc


async def _reap_forever(table: ObjectTable) -> None:
    """Reap expired leases and abandoned writes while the store runs."""
    while True:
        await asyncio.sleep(_REAP_INTERVAL_S)
        table.reap()


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait for it to finish."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _close_engine(engine: TransferEngine) -> None:
    """Stop the transfer engine (its listener, connections and the shared pool)."""
    engine.close()
