"""`--role conductor`: the OpenAI API, the instance registry and the disaggregated request path.

A request walks: OpenAI API (validate, chat template, length check) -> RequestPath
(request_path.py: block keys, Algorithm 1's plan or an immediate 429, decode reservation,
prefill job, decode stream, moves on faults) -> tokens streamed back.
Instances join through POST /internal/register and stay picked while their heartbeats arrive.
Store nodes also report what they hold to the global store index (/internal/store/*), which
engine roles ask where blocks live and where new ones go.
With --etcd, any number of conductors run side by side: each publishes itself in etcd and
mirrors the instances published there into its own registry (etcd_feed.py); instances register,
heartbeat and report to every one of them, so each keeps a full view of its own.
The conductor loads only the tokenizer and model config, never the weights.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncake_server.api.errors import install_error_handlers
from mooncake_server.api.limits import RequestLimits
from mooncake_server.api.metrics import ApiMetrics
from mooncake_server.api.openai_app import create_api_router, install_api_guard
from mooncake_server.api.prompts import load_eos_token_ids
from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.loading import load_perf_model
from mooncake_server.discovery.etcd import EtcdSettings
from mooncake_server.model_assets import resolve_model, served_name
from mooncake_server.roles.conductor.etcd_feed import EtcdCollector, RegistryFeed
from mooncake_server.roles.conductor.master_link import LocalMaster, MasterLink, RemoteMaster
from mooncake_server.roles.conductor.operator_routes import MovesCollector, operator_router
from mooncake_server.roles.conductor.registry import (
    INSTANCE_ROLES,
    InstanceRegistry,
    registry_router,
)
from mooncake_server.roles.conductor.request_path import RequestPath
from mooncake_server.roles.conductor.scheduler import build_scheduler
from mooncake_server.roles.conductor.scheduler.local_index import (
    LocalCacheIndex,
    local_cache_router,
)
from mooncake_server.roles.conductor.scheduler.metrics import SchedulerCollector
from mooncake_server.roles.master.master import (
    MasterCollector,
    StoreMaster,
    master_router,
    serve_index_channel,
)
from mooncake_server.wire.auth import metrics_response
from mooncake_server.wire.instances import ConductorInfo

log = logging.getLogger(__name__)


class _InstancesCollector(Collector):
    """Exports the number of live instances per role at scrape time."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One gauge sample per role."""
        family = GaugeMetricFamily(
            "mooncake_conductor_instances_alive", "Live instances per role", labels=["role"])
        for role, count in self._registry.counts().items():
            family.add_metric([role], count)
        yield family


def _load_model_meta(model_path: str) -> tuple[Any, Any, list[int]]:
    """Tokenizer, model config and EOS ids (blocking: file I/O and parsing)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    hf_config = AutoConfig.from_pretrained(model_path)
    return tokenizer, hf_config, load_eos_token_ids(model_path, tokenizer)


def _max_model_len(config: ServerConfig, hf_config: Any) -> int:
    native = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if native is None:
            raise ValueError("--max-model-len: required, the model config has no "
                             "max_position_embeddings")
        return int(native)
    if native is not None and config.max_model_len > native:
        log.warning("--max-model-len %d exceeds the model's max_position_embeddings %d",
                    config.max_model_len, native)
    return config.max_model_len


class Conductor:
    """The conductor's state: registry, store index, scheduler, metrics; the request path once
    the tokenizer is loaded (lifespan)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.prom = CollectorRegistry()
        self.registry = InstanceRegistry(config.heartbeat_timeout_s)
        # The store master: inside this conductor, or a standalone one (--master).
        self.store_master: StoreMaster | None = None
        self.master: MasterLink
        if config.master_base:
            self.master = RemoteMaster(config.master_base, config.cluster_secret)
        else:
            self.store_master = StoreMaster(self.registry, config.store_replicas,
                                            config.cluster_secret,
                                            lease_s=config.kv_lease_ttl_ms / 1000)
            self.master = LocalMaster(self.store_master)
        # Prefill instances report their own prefix caches here (per-instance hits).
        self.local_caches = LocalCacheIndex()
        # Algorithm 1 (--policy, --ttft-slo, --tbt-slo); a bad --profile fails here, at start-up.
        self.scheduler = build_scheduler(config, self.registry, self.master,
                                         local=self.local_caches)
        self.api_metrics = ApiMetrics(self.prom)
        self.limits = RequestLimits.from_config(config)
        self.path: RequestPath | None = None
        self.feed: RegistryFeed | None = None
        settings = EtcdSettings.from_config(config)
        if settings is not None:
            me = ConductorInfo(conductor_id=f"conductor@{config.public_host}:{config.port}",
                               url=config.base_url)
            self.feed = RegistryFeed(settings, self.registry, me)
            self.prom.register(EtcdCollector(self.feed))
        for collector in (_InstancesCollector(self.registry),
                          SchedulerCollector(self.scheduler), MovesCollector(self.current_path)):
            self.prom.register(collector)
        if self.store_master is not None:
            self.prom.register(MasterCollector(self.store_master))

    def current_path(self) -> RequestPath | None:
        """The request path, None before the lifespan built it (operator routes, metrics)."""
        return self.path

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Index channel, then the API (tokenizer, request path) for as long as the app runs."""
        config = self.config
        # Store nodes' index reports: HTTP for the first, this binary channel after (master.py).
        channel = None
        if self.store_master is not None:
            channel = await serve_index_channel(self.store_master, config.host,
                                                config.index_control_port, config.public_host,
                                                config.cluster_secret)
        try:
            async with self._serve_api(app):
                yield
        finally:
            if self.feed is not None:
                await self.feed.stop()
            if channel is not None:
                await channel.close()
            if isinstance(self.master, RemoteMaster):
                await self.master.aclose()

    @asynccontextmanager
    async def _serve_api(self, app: FastAPI) -> AsyncIterator[None]:
        config = self.config
        model_path = await asyncio.to_thread(resolve_model, config.model)
        tokenizer, hf_config, eos_ids = await asyncio.to_thread(_load_model_meta, model_path)
        max_model_len = _max_model_len(config, hf_config)
        model_name = served_name(config.model, config.served_model_name)
        # NOTE: no overall timeout: decode streams live as long as generation does; the
        # request path sets per-request connect/read limits.
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
        ) as http:
            if not config.profile_path:  # size the built-in model's KV bytes to this model
                self.scheduler.model = load_perf_model(config.profile_path, config.block_tokens,
                                                       config.dtype, hf_config)
            if isinstance(self.master, LocalMaster):
                self.master.http = http  # hot-block copies go out on the request path's client
            self.path = RequestPath(config, self.registry, http, self.scheduler, self.master)
            app.state.backend = self.path
            # Routes need the tokenizer, so they join once it is loaded (before serving) and
            # leave with this lifespan (a restarted app gets fresh ones).
            before = list(app.router.routes)
            app.include_router(create_api_router(
                self.path, tokenizer, model_name, max_model_len, self.prom,
                eos_token_ids=eos_ids, metrics=self.api_metrics, limits=self.limits,
                log_prompts=config.log_prompts))
            api_routes = [r for r in app.router.routes if r not in before]
            if self.feed is not None:
                # NOTE: last before serving: the instances etcd knows are registered, and this
                # conductor is published only now that it is about to listen for them.
                await self.feed.start()
            log.info("conductor serving %s (max_model_len %d) on %s", model_name,
                     max_model_len, config.base_url)
            try:
                yield
            finally:
                log.info("conductor shutting down")
                app.router.routes[:] = [r for r in app.router.routes if r not in api_routes]
                try:  # tail removals and releases the last requests left, while http is open
                    await asyncio.wait_for(self.path.settled(), 5.0)
                except TimeoutError:
                    log.warning("background store calls still running at shutdown")
                self.path = None

    async def health(self) -> Response:
        """200 once a prefill, a decode and a store instance are alive; else 503."""
        counts = self.registry.counts()
        if not self.master.registers_stores:
            counts["store"] = await self.master.store_nodes()
        ok = all(counts[role] > 0 for role in INSTANCE_ROLES)
        body: dict[str, Any] = {"status": "ok" if ok else "waiting for instances",
                                "instances": counts}
        if self.feed is not None:  # NOTE: etcd lost is no failure: the view held is served
            body["etcd"] = "connected" if self.feed.connected else "unreachable (serving the " \
                "instances known)"
        return JSONResponse(body, status_code=200 if ok else 503)


def build_app(config: ServerConfig) -> FastAPI:
    """The conductor's HTTP app; the tokenizer is loaded when it starts (lifespan)."""
    conductor = Conductor(config)
    secret = config.cluster_secret
    app = FastAPI(title="mooncake-server conductor", lifespan=conductor.lifespan)
    install_error_handlers(app)
    install_api_guard(app, api_key=config.api_key, secret=secret,
                      max_body_bytes=conductor.limits.max_body_bytes)
    app.state.registry = conductor.registry
    app.state.store_master = conductor.store_master
    routers = [registry_router(conductor.registry, secret),
               operator_router(conductor.current_path, secret),
               local_cache_router(conductor.local_caches, secret)]
    if conductor.store_master is not None:
        routers.append(master_router(conductor.store_master, secret))
    for router in routers:
        app.include_router(router)

    @app.get("/health")
    async def health() -> Response:
        """200 once a prefill, a decode and a store instance are alive; else 503."""
        return await conductor.health()

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """Prometheus metrics of the API layer, the registry, the scheduler and the moves."""
        return metrics_response(conductor.prom)

    return app
