"""Prefill role: turns a prompt into KV blocks in the store and the first output token.

A job walks, in order:
  queued (one forward pass at a time) -> prefix lookup in the global store index -> prefix blocks
  loaded into the local paged cache from whichever replicas hold them -> uncached tokens computed in
  chunks of --prefill-chunk -> first token sampled -> new full blocks and the partial tail block
  written to their store nodes (blocks the store cannot take are left for decode to recompute)
  -> local blocks freed -> result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram

from mooncake_server.config import ServerConfig
from mooncake_server.engine.factory import build_runner
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.engine.kv_io import KVStoreLink
from mooncake_server.engine.model_runner import ModelRunner, StepItem
from mooncake_server.engine.sampler import sample_token
from mooncake_server.engine.sequence import Sequence
from mooncake_server.internal_http import metrics_response, require_secret
from mooncake_server.messages import Heartbeat, InstanceInfo, PrefillJob, PrefillResult
from mooncake_server.registry import Registrar
from mooncake_server.roles.common import instance_id, internal_client, make_transfer_engine
from mooncake_server.store.client import StoreError

log = logging.getLogger(__name__)


class PrefillMetrics:
    """Prometheus series of the prefill role."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter("mooncake_prefill_jobs", "Prefill jobs by outcome", ["outcome"],
                            registry=registry)
        self.computed_tokens = Counter("mooncake_prefill_computed_tokens",
                                       "Prompt tokens computed", registry=registry)
        self.cached_tokens = Counter("mooncake_prefill_cached_tokens",
                                     "Prompt tokens loaded from the store", registry=registry)
        self.seconds = Histogram("mooncake_prefill_seconds", "Prefill job wall time",
                                 registry=registry)
        self.store_errors = Counter("mooncake_prefill_store_errors",
                                    "KV loads / saves the store could not serve (recomputed)",
                                    ["op"], registry=registry)


class PrefillWorker:
    """Runs prefill jobs one after another over one model and one KV pool."""

    def __init__(self, runner: ModelRunner, link: KVStoreLink, executor: ThreadPoolExecutor,
                 config: ServerConfig, max_model_len: int, metrics: PrefillMetrics) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.link = link
        self.executor = executor
        self.config = config
        self.max_model_len = max_model_len
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self.queued = 0

    async def run(self, job: PrefillJob) -> PrefillResult:
        """Prefill one job (serialised with the others)."""
        self.queued += 1
        try:
            async with self._lock:
                return await self._run(job)
        finally:
            self.queued -= 1

    async def _run(self, job: PrefillJob) -> PrefillResult:
        started = time.perf_counter()
        bt = self.kv.layout.block_tokens
        n = len(job.prompt_token_ids)
        seq = Sequence(job.request_id, list(job.prompt_token_ids), n, job.sampling,
                       self.max_model_len)
        seq.block_ids = self.kv.allocate(self.kv.layout.blocks_for(n))
        try:
            # At least one prompt token must be computed to get logits for the first token.
            reusable = job.block_keys[:(n - 1) // bt]
            loaded = await self._load_prefix(reusable, seq.block_ids)
            seq.num_computed = loaded * bt
            logits = None
            loop = asyncio.get_running_loop()
            while seq.num_pending > 0:
                chunk = min(seq.num_pending, self.config.prefill_chunk_tokens)
                logits = await loop.run_in_executor(
                    self.executor, self.runner.step, [StepItem(seq, chunk)])
                seq.num_computed += chunk
            first = sample_token(logits[0], job.sampling, seq.generator)  # type: ignore[index]
            self.metrics.computed_tokens.inc(n - loaded * bt)
            self.metrics.cached_tokens.inc(loaded * bt)

            full = n // bt
            tail_key = f"tail/{job.request_id}" if n % bt else None
            checksums = await self.link.checksums(seq.block_ids)
            keys = job.block_keys[loaded:full] + ([tail_key] if tail_key else [])
            await self._save(keys, seq.block_ids[loaded:], checksums[loaded:])
        finally:
            self.kv.free(seq.block_ids)
        elapsed = time.perf_counter() - started
        self.metrics.seconds.observe(elapsed)
        return PrefillResult(request_id=job.request_id, first_token=first,
                             cached_tokens=loaded * bt, tail_key=tail_key,
                             block_checksums=checksums, prefill_seconds=elapsed)


    async def _load_prefix(self, keys: list[str], block_ids: list[int]) -> int:
        """Cached prefix blocks read into `block_ids`; 0 (compute everything) if the store fails."""
        if not keys:
            return 0
        try:
            return await self.link.load(keys, block_ids, fallback=False)
        except StoreError as exc:
            log.warning("prefix lookup failed, computing the whole prompt: %s", exc)
            self.metrics.store_errors.labels("load").inc()
            return 0

    async def _save(self, keys: list[str], block_ids: list[int], checksums: list[int]) -> None:
        """Write new blocks; blocks the store cannot take are recomputed by the decode side."""
        try:
            stored = await self.link.save(keys, block_ids, checksums)
        except StoreError as exc:
            log.warning("storing %d KV blocks failed: %s", len(keys), exc)
            self.metrics.store_errors.labels("save").inc()
            return
        if not all(stored):
            log.warning("the store refused %d of %d KV blocks (full); decode recomputes them",
                        stored.count(False), len(keys))
            self.metrics.store_errors.labels("refused").inc()


def build_app(config: ServerConfig) -> FastAPI:
    """The prefill instance's internal HTTP API."""
    registry = CollectorRegistry()
    metrics = PrefillMetrics(registry)
    state: dict[str, PrefillWorker] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_transfer_engine(config, serve=False)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-forward")
        runner, info = await asyncio.to_thread(
            build_runner, config, lambda nbytes: engine.alloc_shared("prefill-kv", nbytes))
        http = internal_client(config)
        link = KVStoreLink(runner.kv, engine, http, config.cluster_secret,
                           config.conductor_url or "")
        worker = PrefillWorker(runner, link, executor, config, info.max_model_len, metrics)
        state["worker"] = worker
        registrar = Registrar(
            config.conductor_url or "", InstanceInfo(
                instance_id=instance_id(config), role="prefill", url=config.base_url,
                model=info.name),
            config.cluster_secret, config.heartbeat_interval_s,
            load=lambda: Heartbeat(instance_id=instance_id(config), waiting=worker.queued,
                                   free_blocks=runner.kv.num_free))
        await registrar.start()
        log.info("prefill instance %s ready", instance_id(config))
        try:
            yield
        finally:
            await registrar.stop()
            await http.aclose()
            executor.shutdown(wait=True)
            engine.close()

    app = FastAPI(title="mooncake-server prefill", lifespan=lifespan)
    guard = Depends(require_secret(config.cluster_secret))

    @app.post("/internal/prefill", dependencies=[guard])
    async def prefill(job: PrefillJob) -> PrefillResult:
        """Run one prefill job."""
        try:
            result = await state["worker"].run(job)
        except OutOfBlocks as exc:
            metrics.jobs.labels("no_kv_memory").inc()
            raise HTTPException(503, f"prefill KV cache full: {exc}") from exc
        except StoreError as exc:
            metrics.jobs.labels("store_error").inc()
            raise HTTPException(503, f"store transfer failed: {exc}") from exc
        metrics.jobs.labels("ok").inc()
        return result

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():  # noqa: ANN202
        """Prometheus metrics."""
        return metrics_response(registry)

    return app
