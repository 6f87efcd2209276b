"""The store role: one node's DRAM pool (+ SSD tier), served over the transfer engine, steered
over HTTP, reported to the conductor's global index.

Start-up (lifespan): transfer engine -> shared-memory pool registered as a segment -> SSD tier
(files a previous run left are loaded) -> StoreNode -> registration with the conductor (then
heartbeats) -> index reporter (snapshot, then deltas) -> reaper and idle-demotion loops.
A block walks: put_start (WRITING, space reserved) -> the writer's one-sided WRITEs -> put_end
(READY, reported) -> get (leased, pinned; rehydrated first if only on SSD) -> the reader's
one-sided READs -> release -> idle or LRU-evicted to SSD, or removed.
Endpoints only move metadata, except /store/replicate, where this node pulls a hot block from
another node through the transfer engine; bytes never pass through Python code.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Depends, FastAPI, HTTPException
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from mooncake_server.config import ServerConfig
from mooncake_server.instance import engine_role
from mooncake_server.instance.app import Starting, instance_app
from mooncake_server.roles.store.keyed import EngineKeyedReads
from mooncake_server.roles.store.metrics import NodeCollector
from mooncake_server.roles.store.node import StoreNode
from mooncake_server.roles.store.objects import ObjectTable
from mooncake_server.roles.store.reporter import IndexReporters
from mooncake_server.roles.store.service import Call, StoreService
from mooncake_server.roles.store.ssd import SsdTier
from mooncake_server.store_client.client import StoreClient, StoreError
from mooncake_server.transfer import TransferEngine, crc32c_many
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.index import StoreReplicate, StoreReplicateReply
from mooncake_server.wire.instances import InstanceInfo, StoreLocation
from mooncake_server.wire.routes import STORE_REPLICATE, STORE_ROUTES, serve
from mooncake_server.wire.rpc import RpcServer, RpcUnavailable

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
    node: StoreNode
    location: StoreLocation
    http: httpx.AsyncClient
    secret: str
    reporter: IndexReporters | None = None

    @property
    def table(self) -> ObjectTable:
        """The DRAM object table."""
        return self.node.table


def build_app(config: ServerConfig) -> FastAPI:
    """The store role's FastAPI app; the lifespan owns the engine, the pool and registration."""
    instance_id = engine_role.instance_id(config)

    async def start(starting: Starting) -> None:
        app, stack = starting.app, starting.stack
        engine = engine_role.make_transfer_engine(config, serve=True)
        stack.callback(engine.close)
        pool = engine.alloc_shared(SEGMENT_NAME, config.store_memory_bytes)
        pool_addr = ctypes.addressof(ctypes.c_char.from_buffer(pool))
        ssd = None
        if config.store_ssd_dir:
            ssd = SsdTier(config.store_ssd_dir, config.store_ssd_capacity_bytes)
            await ssd.open()
            stack.push_async_callback(ssd.close)  # pending writes finish before exit
        reporter: IndexReporters | None = None
        node = StoreNode(pool, pool_addr, ssd=ssd, demote_after_s=config.store_demote_after_s,
                         high_watermark=config.store_high_watermark,
                         report=lambda entry: reporter.changed(entry) if reporter else None,
                         keyed=EngineKeyedReads(engine, SEGMENT_NAME))
        http = engine_role.internal_client(config)
        stack.push_async_callback(http.aclose)
        # Peers dial the advertised host, not the (possibly wildcard) listen address.
        address = f"{config.public_host}:{engine.address.rsplit(':', 1)[1]}"
        rpc = RpcServer(service.rpc_handlers(), config.secret_bytes,
                        on_disconnect=service.disconnected)
        control_port = await rpc.start(config.host, config.store_control_port)
        stack.push_async_callback(rpc.close)
        control = f"{config.public_host}:{control_port}"
        location = StoreLocation(instance_id=instance_id, url=config.base_url,
                                 transfer_address=address, segment=SEGMENT_NAME,
                                 control_address=control)
        runtime = StoreRuntime(engine, pool, node, location, http, config.cluster_secret)
        app.state.store = runtime
        stack.push_async_callback(_cancel, asyncio.create_task(
            _reap_forever(node), name="store-reaper"))
        if ssd is not None:
            stack.push_async_callback(_cancel, asyncio.create_task(
                _demote_forever(node), name="store-demoter"))
        if config.conductor_url or config.etcd_endpoints or config.master_base:
            info = InstanceInfo(instance_id=instance_id, role="store", url=config.base_url,
                                transfer_address=address, segment=SEGMENT_NAME,
                                control_address=control)
            await starting.join(info, busy=lambda: node.stats().active_leases > 0,
                                what="store leases")
            reporter = IndexReporters((await starting.cluster()).conductors, instance_id,
                                      config.cluster_secret, node.snapshot)
            runtime.reporter = reporter
            await reporter.start()
            stack.push_async_callback(reporter.stop)
        else:
            logger.warning("no conductor URL: store %s runs unregistered", instance_id)
        # Unwound first: the routes answer 503 before anything they use stops.
        stack.callback(_stopped, app)
        stack.callback(logger.info, "store %s shutting down", instance_id)
        logger.info("store %s up: %d bytes at segment %s via %s, control %s%s", instance_id,
                    len(pool), SEGMENT_NAME, address, control,
                    f", SSD tier {config.store_ssd_dir}" if ssd is not None else "")

    def health() -> dict[str, Any]:
        return {"status": "ok", "role": "store", **runtime().location.model_dump()}

    metrics = CollectorRegistry()
    app = instance_app(config, "mooncake-server store", metrics, start, status=health)
    metrics.register(NodeCollector(lambda: _node_or_none(app)))
    guard = [Depends(require_secret(config.cluster_secret))]
    service = StoreService(lambda: _node_or_none(app))
    app.state.service = service

    def runtime() -> StoreRuntime:
        rt: StoreRuntime | None = getattr(app.state, "store", None)
        if rt is None:
            raise HTTPException(status_code=503, detail="store is starting")
        return rt

    # NOTE: every route is `async def` so it runs on the event loop, which serialises all table
    # access; a plain `def` route would run in a thread pool and race.
    for op, method in service.calls().items():
        route = STORE_ROUTES[op]
        serve(app, route, dependencies=guard, name=f"store_{op.name.lower()}")(
            _http_route(route.request, method))

    @serve(app, STORE_REPLICATE, dependencies=guard)
    async def replicate(body: StoreReplicate) -> StoreReplicateReply:
        """Copy keys from another node into this one (hot-block replication)."""
        if len(body.keys) != len(body.sizes) or any(s <= 0 for s in body.sizes):
            raise HTTPException(status_code=400, detail="replicate: one positive size per key")
        return StoreReplicateReply(copied=await _pull(runtime(), body))

    return app


def _stopped(app: FastAPI) -> None:
    app.state.store = None


async def _pull(rt: StoreRuntime, body: StoreReplicate) -> int:
    """Copy keys from another node into this pool (hot-block replication); count those held."""
    node = rt.node
    res = node.put_start(body.keys, body.sizes)
    placed = [i for i, off in enumerate(res.offsets) if off is not None]
    if placed:
        offsets = [res.offsets[i] or 0 for i in placed]
        keys = [body.keys[i] for i in placed]
        sizes = [body.sizes[i] for i in placed]
        addrs = [node.pool_addr + off for off in offsets]
        source = StoreClient(body.source, rt.engine, rt.http, rt.secret)
        try:
            arrived = await source.get_any(keys, addrs, sizes)
        except StoreError as exc:
            logger.warning("pulling %d keys from %s failed: %s", len(keys),
                           body.source.instance_id, exc)
            arrived = [False] * len(keys)
        finally:
            await source.aclose()
        ok = [i for i, a in enumerate(arrived) if a]

        def checksums() -> list[int]:
            return crc32c_many([addrs[i] for i in ok], [sizes[i] for i in ok])

        # The source already verified these bytes against its CRC32C; this is the same value.
        sums = await asyncio.to_thread(checksums)
        node.put_end([keys[i] for i in ok], sums)
        node.put_abort([keys[i] for i, a in enumerate(arrived) if not a])
    return sum(node.tier_of(k) is not None for k in body.keys)


def _http_route(model: type[BaseModel], method: Call) -> Callable[[Any], Awaitable[BaseModel]]:
    """One control call as a FastAPI endpoint taking `model` as its JSON body."""
    async def route(body: BaseModel) -> BaseModel:
        try:
            reply = method(body)
            return await reply if inspect.isawaitable(reply) else reply
        except RpcUnavailable as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
    # FastAPI reads the body's type from the signature; no return annotation, so the reply is
    # serialised as the model it is.
    route.__annotations__ = {"body": model}
    return route


def _node_or_none(app: FastAPI) -> StoreNode | None:
    rt: StoreRuntime | None = getattr(app.state, "store", None)
    return rt.node if rt is not None else None


async def _reap_forever(node: StoreNode) -> None:
    """Reap expired leases and abandoned writes while the store runs."""
    while True:
        await asyncio.sleep(_REAP_INTERVAL_S)
        node.table.reap()


async def _demote_forever(node: StoreNode) -> None:
    """Move idle objects to SSD while the store runs."""
    interval = min(1.0, node.demote_after_s / 4)
    while True:
        await asyncio.sleep(interval)
        try:
            await node.demote_idle()
        except Exception:
            logger.exception("idle demotion pass failed")


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait for it to finish."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
