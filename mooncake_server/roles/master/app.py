"""`--role master`: the store master as its own process, no model loaded (Mooncake's
`mooncake_master`, default port 50051).

It runs the instance registry store nodes register and heartbeat with, the global store index
they report to (HTTP first, then the binary channel), placement, read leases and hot-block
copies (master.py), and `/metadata`, a small key-value endpoint like
`mooncake_master --enable_http_metadata_server`. Engines (`--master`), conductors (`--master`)
and Mooncake API clients (`mooncake_server.mooncake_api`) ask it where blocks live.
With --etcd it mirrors the instances published there (as a conductor does) and publishes
itself under `masters/`, not `conductors/`, so engine instances do not register with it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncake_server.api.errors import install_error_handlers
from mooncake_server.config import ServerConfig
from mooncake_server.discovery.etcd import EtcdSettings
from mooncake_server.roles.conductor.etcd_feed import EtcdCollector, RegistryFeed
from mooncake_server.roles.conductor.registry import InstanceRegistry, registry_router
from mooncake_server.roles.master.master import (
    MasterCollector,
    StoreMaster,
    master_router,
    serve_index_channel,
)
from mooncake_server.wire.auth import metrics_response, require_secret
from mooncake_server.wire.instances import ConductorInfo

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051  # mooncake_master's RPC port
_MAX_METADATA_BYTES = 1 << 20


class _StoresCollector(Collector):
    """Live store nodes, read at scrape time."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One gauge."""
        yield GaugeMetricFamily("mooncake_master_store_nodes_alive", "live store nodes",
                                value=len(self._registry.alive("store")))


def metadata_router(secret: str) -> APIRouter:
    """GET / PUT / DELETE /metadata?key=K: an in-memory key-value map, as Mooncake's HTTP
    metadata server keeps transfer-engine segment descriptors (cluster secret required)."""
    router = APIRouter(dependencies=[Depends(require_secret(secret))])
    values: dict[str, bytes] = {}

    @router.get("/metadata")
    async def get_value(key: str) -> Response:
        """The value stored under `key` (404 if none)."""
        if key not in values:
            return Response(b"metadata not found", status_code=404, media_type="text/plain")
        return Response(values[key], media_type="application/json")

    @router.put("/metadata")
    async def put_value(key: str, request: Request) -> Response:
        """Store the body under `key`."""
        body = await request.body()
        if len(body) > _MAX_METADATA_BYTES:
            return Response(b"metadata value too large", status_code=413,
                            media_type="text/plain")
        values[key] = body
        return Response(b"metadata updated", media_type="text/plain")

    @router.delete("/metadata")
    async def delete_value(key: str) -> Response:
        """Forget `key` (404 if none)."""
        if values.pop(key, None) is None:
            return Response(b"metadata not found", status_code=404, media_type="text/plain")
        return Response(b"metadata deleted", media_type="text/plain")

    return router


def build_app(config: ServerConfig) -> FastAPI:
    """The master's HTTP app; the index channel and the etcd feed live in its lifespan."""
    registry = InstanceRegistry(config.heartbeat_timeout_s)
    master = StoreMaster(registry, config.store_replicas, config.cluster_secret,
                         lease_s=config.kv_lease_ttl_ms / 1000)
    prom = CollectorRegistry()
    prom.register(MasterCollector(master))
    prom.register(_StoresCollector(registry))
    feed: RegistryFeed | None = None
    settings = EtcdSettings.from_config(config)
    if settings is not None:
        me = ConductorInfo(conductor_id=f"master@{config.public_host}:{config.port}",
                           url=config.base_url)
        feed = RegistryFeed(settings, registry, me, own_key=settings.master_key(me.conductor_id))
        prom.register(EtcdCollector(feed))
    # NOTE: hot-block copies ask target nodes to pull: one client for the master's life.
    http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            stack.push_async_callback(http.aclose)
            channel = await serve_index_channel(master, config.host, config.index_control_port,
                                                config.public_host, config.cluster_secret)
            stack.push_async_callback(channel.close)
            if feed is not None:
                await feed.start()
                stack.push_async_callback(feed.stop)
            log.info("store master on %s (index channel %s, %d replica(s) per key, leases "
                     "%d ms)", config.base_url, master.channel, master.replicas,
                     config.kv_lease_ttl_ms)
            yield
            log.info("store master shutting down")

    app = FastAPI(title="mooncake-server master", lifespan=lifespan)
    install_error_handlers(app)
    app.state.registry = registry
    app.state.store_master = master
    app.state.drain = None
    for router in (registry_router(registry, config.cluster_secret),
                   master_router(master, config.cluster_secret, http),
                   metadata_router(config.cluster_secret)):
        app.include_router(router)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness, with the live store nodes and indexed keys."""
        body: dict[str, Any] = {"status": "ok", "role": "master",
                                "stores": len(registry.alive("store")),
                                "keys": master.index.stats().keys}
        if feed is not None:
            body["etcd"] = "connected" if feed.connected else "unreachable"
        return body

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """Prometheus metrics of the index and the registry."""
        return metrics_response(prom)

    return app
