"""`--role conductor`: the OpenAI API, the instance registry and the disaggregated request path.

A request walks: OpenAI API (validate, chat template, length check) -> RequestPath
(request_path.py: block keys, Algorithm 1's plan or an immediate 429, decode reservation,
prefill job, decode stream, moves on faults) -> tokens streamed back.
Instances join through POST /internal/register and stay picked while their heartbeats arrive.
Store nodes also report what they hold to the global store index (/internal/store/*), which
engine roles ask where blocks live and where new ones go.
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
from mooncake_server.model_assets import resolve_model, served_name
from mooncake_server.roles.conductor.operator_routes import MovesCollector, operator_router
from mooncake_server.roles.conductor.registry import (
    INSTANCE_ROLES,
    InstanceRegistry,
    registry_router,
)
from mooncake_server.roles.conductor.request_path import RequestPath
from mooncake_server.roles.conductor.scheduler import build_scheduler, load_perf_model
from mooncake_server.roles.conductor.scheduler.local_index import (
    LocalCacheIndex,
    local_cache_router,
)
from mooncake_server.roles.conductor.scheduler.metrics import SchedulerCollector
from mooncake_server.roles.conductor.store_index.master import (
    MasterCollector,
    StoreMaster,
    master_router,
    serve_index_channel,
)
from mooncake_server.wire.auth import metrics_response

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


def build_app(config: ServerConfig) -> FastAPI:
    """The conductor's HTTP app; the tokenizer is loaded when it starts (lifespan)."""
    prom = CollectorRegistry()
    registry = InstanceRegistry(config.heartbeat_timeout_s)
    prom.register(_InstancesCollector(registry))
    store_master = StoreMaster(registry, config.store_replicas, config.cluster_secret)
    prom.register(MasterCollector(store_master))
    # Algorithm 1 (--policy, --ttft-slo, --tbt-slo); a bad --profile fails here, at start-up.
    # Prefill instances report their own prefix caches here (per-instance hits for Algorithm 1).
    local_caches = LocalCacheIndex()
    scheduler = build_scheduler(config, registry, store_master, local=local_caches)
    prom.register(SchedulerCollector(scheduler))
    api_metrics = ApiMetrics(prom)
    model_name = served_name(config.model, config.served_model_name)
    limits = RequestLimits.from_config(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Store nodes' index reports: HTTP for the first, this binary channel after (master.py).
        channel = await serve_index_channel(store_master, config.host, config.index_control_port,
                                            config.public_host, config.cluster_secret)
        try:
            async with serve_api(app):
                yield
        finally:
            await channel.close()

    @asynccontextmanager
    async def serve_api(app: FastAPI) -> AsyncIterator[None]:
        model_path = await asyncio.to_thread(resolve_model, config.model)
        tokenizer, hf_config, eos_ids = await asyncio.to_thread(_load_model_meta, model_path)
        max_model_len = _max_model_len(config, hf_config)
        # NOTE: no overall timeout: decode streams live as long as generation does; the
        # backend sets per-request connect/read limits.
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
        ) as http:
            if not config.profile_path:  # size the built-in model's KV bytes to this model
                scheduler.model = load_perf_model(config, hf_config)
            backend = RequestPath(config, registry, http, scheduler, store_master)
            app.state.backend = backend
            # Routes need the tokenizer, so they join once it is loaded (before serving) and
            # leave with this lifespan (a restarted app gets fresh ones).
            before = list(app.router.routes)
            app.include_router(create_api_router(
                backend, tokenizer, model_name, max_model_len, prom, eos_token_ids=eos_ids,
                metrics=api_metrics, limits=limits, log_prompts=config.log_prompts))
            api_routes = [r for r in app.router.routes if r not in before]
            log.info("conductor serving %s (max_model_len %d) on %s", model_name,
                     max_model_len, config.base_url)
            try:
                yield
            finally:
                log.info("conductor shutting down")
                app.router.routes[:] = [r for r in app.router.routes if r not in api_routes]

    app = FastAPI(title="mooncake-server conductor", lifespan=lifespan)
    install_error_handlers(app)
    install_api_guard(app, api_key=config.api_key, secret=config.cluster_secret,
                      max_body_bytes=limits.max_body_bytes)
    app.state.registry = registry
    app.include_router(registry_router(registry, config.cluster_secret))
    # Request moves (decode migration, prefill re-sends): /internal/{migrate,requests}, metrics.
    def request_path() -> RequestPath | None:
        return getattr(app.state, "backend", None)

    app.include_router(operator_router(request_path, config.cluster_secret))
    prom.register(MovesCollector(request_path))
    app.state.store_master = store_master
    app.include_router(master_router(store_master, config.cluster_secret))
    app.include_router(local_cache_router(local_caches, config.cluster_secret))

    @app.get("/health")
    async def health() -> Response:
        """200 once a prefill, a decode and a store instance are alive; else 503."""
        counts = registry.counts()
        ok = all(counts[role] > 0 for role in INSTANCE_ROLES)
        body = {"status": "ok" if ok else "waiting for instances", "instances": counts}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """Prometheus metrics of the API layer and the registry."""
        return metrics_response(prom)

    return app
