"""Prefill role: turns a prompt into KV blocks in the store and the first output token.

The HTTP side only: one route takes a job to the worker (`worker.py`: jobs batched into forward
passes, KV written to the store) and maps what can go wrong to the status the conductor acts on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException
from prometheus_client import CollectorRegistry

from mooncake_server.config import ServerConfig
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.instance.app import Starting, instance_app
from mooncake_server.instance.engine_role import instance_id, start_engine
from mooncake_server.roles.conductor.scheduler import load_perf_model
from mooncake_server.roles.prefill.cache_report import CacheReporter
from mooncake_server.roles.prefill.chunk_budget import ChunkBudget
from mooncake_server.roles.prefill.worker import PrefillMetrics, PrefillWorker
from mooncake_server.store_client.client import StoreError
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import PrefillJob, PrefillResult
from mooncake_server.wire.routes import PREFILL, serve

log = logging.getLogger(__name__)


@dataclass
class PrefillState:
    """What the prefill routes read: the metrics, and the worker once the lifespan built it."""

    metrics: PrefillMetrics
    worker: PrefillWorker | None = None

    def running(self) -> PrefillWorker:
        """The worker (only None before start-up, when uvicorn serves no request)."""
        if self.worker is None:
            raise HTTPException(503, "prefill instance is starting")
        return self.worker


def build_app(config: ServerConfig) -> FastAPI:
    """The prefill instance's internal HTTP API."""
    registry = CollectorRegistry()
    state = PrefillState(PrefillMetrics(registry))

    async def start(starting: Starting) -> None:
        parts = await start_engine(starting, "prefill")
        model = load_perf_model(config) if config.tbt_slo_s is not None else None
        chunks = ChunkBudget(config.decode_chunk_tokens, model, config.tbt_slo_s)
        worker = PrefillWorker(parts.runner, parts.link, parts.executor, config,
                               parts.info.max_model_len, state.metrics, chunks)
        conductors = (await starting.cluster()).conductors
        worker.reporter = CacheReporter(conductors.current, instance_id(config),
                                        config.cluster_secret, worker.cache, parts.http)
        state.worker = worker
        info = InstanceInfo(instance_id=instance_id(config), role="prefill", url=config.base_url,
                            model=parts.info.name)
        await starting.join(
            info, busy=lambda: worker.queued > 0, what="prefill jobs",
            load=lambda: Heartbeat(instance_id=instance_id(config), waiting=worker.queued,
                                   free_blocks=worker.cache.num_available,
                                   passes=worker.pass_split()))
        await worker.reporter.flush()  # the conductor learns this (empty) cache's epoch
        log.info("prefill instance %s ready", instance_id(config))

    app = instance_app(config, "mooncake-server prefill", registry, start)
    guard = Depends(require_secret(config.cluster_secret))

    @serve(app, PREFILL, dependencies=[guard])
    async def prefill(job: PrefillJob) -> PrefillResult:
        """Run one prefill job."""
        metrics = state.metrics
        try:
            result = await state.running().run(job)
        except OutOfBlocks as exc:
            metrics.jobs.labels("no_kv_memory").inc()
            raise HTTPException(503, f"prefill KV cache full: {exc}") from exc
        except StoreError as exc:
            metrics.jobs.labels("store_error").inc()
            raise HTTPException(503, f"store transfer failed: {exc}") from exc
        metrics.jobs.labels("ok").inc()
        return result

    return app
