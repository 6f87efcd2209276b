"""Prefill role: turns a prompt into KV blocks in the store and the first output token.

The HTTP side only: one route takes a job to the worker (`worker.py`: jobs batched into forward
passes, KV written to the store) and maps what can go wrong to the status the conductor acts on.
Its answer streams: the first tokens as soon as the prompt is computed (the conductor passes them
to the client at once), then the result once the prompt's KV is in the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.loading import load_perf_model
from mooncake_server.cost_model.passes import seed_pass_tokens
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.instance.app import Starting, instance_app
from mooncake_server.instance.engine_role import (
    after_neighbours_load,
    instance_id,
    start_engine,
)
from mooncake_server.roles.prefill.cache_report import CacheReporter
from mooncake_server.roles.prefill.chunk_budget import ChunkBudget
from mooncake_server.roles.prefill.job_queue import LateForSLO
from mooncake_server.roles.prefill.metrics import PrefillMetrics
from mooncake_server.roles.prefill.worker import PrefillWorker
from mooncake_server.store_client.client import StoreError
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import ErrorEvent, PrefillFirst, PrefillJob, PrefillResult
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
        model = (load_perf_model(config.profile_path, config.block_tokens, config.dtype)
                 if config.tbt_slo_s is not None else None)
        chunks = ChunkBudget(config.decode_chunk_tokens, model, config.tbt_slo_s,
                             block_tokens=config.block_tokens)
        if model is not None:
            kv = parts.runner.kv
            # Long enough that a burst's first pass may run past one chunk (passes.py).
            tokens = seed_pass_tokens(config.prefill_chunk_tokens, parts.info.max_model_len,
                                      kv.num_blocks * kv.layout.block_tokens, long=True)
            await after_neighbours_load(parts.runner.cores)
            seconds = await asyncio.get_running_loop().run_in_executor(
                parts.executor, parts.runner.prompt_pass_s, tokens)
            chunks.seed(tokens, seconds)
            log.info("full prefill pass of %d tokens %.2f s: %.2fx the cost model's",
                     tokens, seconds, seconds / model.prefill_s(tokens))
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
    async def prefill(job: PrefillJob) -> Response:
        """Run one prefill job: NDJSON, its first tokens once the prompt is computed, then its
        result once the KV is in the store (a failure before the first line is a status)."""
        first: asyncio.Future[PrefillFirst] = asyncio.get_running_loop().create_future()

        def on_first(tokens: PrefillFirst) -> None:
            if not first.done():
                first.set_result(tokens)

        # NOTE: its own task: a conductor that goes away mid-answer leaves the job to finish
        # (the store writes commit or abort as they would), as it did before answers streamed.
        running = asyncio.ensure_future(state.running().run(job, on_first))
        running.add_done_callback(_count_outcome)
        await asyncio.wait([running, first], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            return Response(_line(_result_or_status(running)), media_type="application/x-ndjson")

        async def lines() -> AsyncIterator[bytes]:
            yield _line(first.result())
            try:
                result = await asyncio.shield(running)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the conductor re-sends
                yield _line(ErrorEvent(error=f"prefill failed after its first token: {exc}"))
                return
            yield _line(result)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def _count_outcome(running: asyncio.Future[PrefillResult]) -> None:
        exc = None if running.cancelled() else running.exception()
        label = ("ok" if exc is None and not running.cancelled() else
                 "no_kv_memory" if isinstance(exc, OutOfBlocks) else
                 "store_error" if isinstance(exc, StoreError) else
                 "late" if isinstance(exc, LateForSLO) else "failed")
        state.metrics.jobs.labels(label).inc()

    return app


def _result_or_status(running: asyncio.Future[PrefillResult]) -> PrefillResult:
    """A job's result, or what went wrong as the HTTP status the conductor acts on."""
    try:
        return running.result()
    except OutOfBlocks as exc:
        raise HTTPException(503, f"prefill KV cache full: {exc}") from exc
    except StoreError as exc:
        raise HTTPException(503, f"store transfer failed: {exc}") from exc
    except LateForSLO as exc:
        raise HTTPException(429, str(exc)) from exc


def _line(event: BaseModel) -> bytes:
    """One NDJSON line."""
    return event.model_dump_json().encode() + b"\n"
