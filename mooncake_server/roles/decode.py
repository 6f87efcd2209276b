"""Decode role: loads a prefilled request's KV from the store and decodes it in a continuous batch.

A request walks, in order:
  blocks reserved in the local paged cache -> prompt KV read from the store (full blocks by chained
  key, then the partial tail block, from any live replica) and checksums verified; blocks the
  store no longer holds are left to recompute -> waiting -> running in the engine loop
  (one token per step, sharing forward passes with every other running request) -> finished; each
  token is streamed back to the conductor as one NDJSON line. A closed stream cancels the request and
  frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from mooncake_server.config import ServerConfig
from mooncake_server.engine.factory import build_runner
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.engine.kv_io import KVStoreLink
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.engine.sequence import Sequence
from mooncake_server.internal_http import metrics_response, require_secret
from mooncake_server.messages import DecodeEvent, DecodeJob, ErrorEvent, Heartbeat, InstanceInfo
from mooncake_server.registry import Registrar
from mooncake_server.roles.common import instance_id, internal_client, make_transfer_engine
from mooncake_server.store.client import StoreError
from mooncake_server.transfer import TransferError

log = logging.getLogger(__name__)


class KVLoadError(Exception):
    """The prompt's KV could not be brought into the local cache."""


class DecodeService:
    """Admits decode jobs: loads their KV, hands them to the engine loop, streams their tokens."""

    def __init__(self, loop: EngineLoop, link: KVStoreLink, max_model_len: int,
                 failures: Counter, verified: Counter, recomputed: Counter) -> None:
        self.loop = loop
        self.kv = loop.kv
        self.link = link
        self.max_model_len = max_model_len
        self.failures = failures
        self.verified = verified
        self.recomputed = recomputed

    async def admit(self, job: DecodeJob) -> Sequence:
        """Load the job's KV and queue it; raises KVLoadError or OutOfBlocks."""
        bt = self.kv.layout.block_tokens
        n = len(job.prompt_token_ids)
        seq = Sequence(job.request_id, [*job.prompt_token_ids, job.first_token], n, job.sampling,
                       self.max_model_len)
        seq.block_ids = self.kv.allocate(self.kv.layout.blocks_for(n))
        try:
            keys = job.block_keys[:n // bt] + ([job.tail_key] if job.tail_key else [])
            try:
                got = await self.link.load(keys, seq.block_ids)
            except StoreError as exc:
                log.warning("loading KV of %s failed, recomputing it: %s", job.request_id, exc)
                got = 0
            if got and job.block_checksums:
                sums = await self.link.checksums(seq.block_ids[:got])
                bad = [i for i, (a, b) in enumerate(zip(sums, job.block_checksums)) if a != b]
                if bad:
                    raise KVLoadError(f"KV block checksum mismatch at block(s) {bad[:4]}")
                self.verified.inc(len(sums))
        except BaseException:
            self.kv.free(seq.block_ids)
            seq.block_ids = []
            raise
        if job.tail_key:
            # The tail block is private to this request: drop it from the store once we hold it.
            asyncio.create_task(self._drop_tail(job))
        # NOTE: blocks the store lost (a dead node without replicas, a refused put) are
        # recomputed by the engine loop as prompt chunks before the next token: never a failure.
        seq.num_computed = min(got * bt, n)
        if got < len(keys):
            self.recomputed.inc(n - seq.num_computed)
        self.loop.submit(seq)
        return seq

    async def _drop_tail(self, job: DecodeJob) -> None:
        try:
            await self.link.remove([job.tail_key or ""])
        except Exception as exc:  # the store's LRU reclaims it anyway
            log.warning("could not remove tail block %s: %s", job.tail_key, exc)

    async def stream(self, seq: Sequence) -> AsyncIterator[bytes]:
        """NDJSON lines of DecodeEvent / ErrorEvent until the sequence finishes."""
        try:
            while True:
                ev = await seq.events.get()
                if ev is None:
                    if seq.error:
                        self.failures.labels("engine").inc()
                        yield ErrorEvent(error=seq.error).model_dump_json().encode() + b"\n"
                    return
                token, reason, batch = ev
                yield DecodeEvent(token_id=token, finish_reason=reason,
                                  batch_size=batch).model_dump_json().encode() + b"\n"
        finally:
            self.loop.cancel(seq)  # no-op if finished; frees blocks if the client went away


def build_app(config: ServerConfig) -> FastAPI:
    """The decode instance's internal HTTP API."""
    registry = CollectorRegistry()
    engine_metrics = EngineMetrics(registry)
    failures = Counter("mooncake_decode_failures", "Decode jobs that failed", ["stage"],
                       registry=registry)
    verified = Counter("mooncake_decode_kv_blocks_verified",
                       "KV blocks read from the store whose CRC32C matched prefill's",
                       registry=registry)
    recomputed = Counter("mooncake_decode_recomputed_tokens",
                         "Prompt tokens whose KV the store no longer held, recomputed here",
                         registry=registry)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_transfer_engine(config, serve=False)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-forward")
        runner, info = await asyncio.to_thread(
            build_runner, config, lambda nbytes: engine.alloc_shared("decode-kv", nbytes))
        http = internal_client(config)
        loop = EngineLoop(runner, executor, engine_metrics, config.max_batch_size,
                          config.prefill_chunk_tokens)
        loop.start()
        link = KVStoreLink(runner.kv, engine, http, config.cluster_secret,
                           config.conductor_url or "")
        state["service"] = DecodeService(loop, link, info.max_model_len, failures, verified,
                                         recomputed)
        registrar = Registrar(
            config.conductor_url or "", InstanceInfo(
                instance_id=instance_id(config), role="decode", url=config.base_url,
                model=info.name),
            config.cluster_secret, config.heartbeat_interval_s,
            load=lambda: Heartbeat(instance_id=instance_id(config), running=loop.load[0],
                                   waiting=loop.load[1], free_blocks=runner.kv.num_free))
        await registrar.start()
        log.info("decode instance %s ready", instance_id(config))
        try:
            yield
        finally:
            await registrar.stop()
            await loop.stop()
            await http.aclose()
            executor.shutdown(wait=True)
            engine.close()

    app = FastAPI(title="mooncake-server decode", lifespan=lifespan)
    guard = Depends(require_secret(config.cluster_secret))

    @app.post("/internal/decode", dependencies=[guard])
    async def decode(job: DecodeJob) -> StreamingResponse:
        """Load a prefilled request and stream its remaining tokens as NDJSON."""
        service: DecodeService = state["service"]
        try:
            seq = await service.admit(job)
        except OutOfBlocks as exc:
            failures.labels("no_kv_memory").inc()
            raise HTTPException(503, f"decode KV cache full: {exc}") from exc
        except (KVLoadError, StoreError, TransferError) as exc:
            failures.labels("kv_load").inc()
            raise HTTPException(503, f"loading KV from the store failed: {exc}") from exc
        return StreamingResponse(service.stream(seq), media_type="application/x-ndjson")

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():  # noqa: ANN202
        """Prometheus metrics."""
        return metrics_response(registry)

    return app
