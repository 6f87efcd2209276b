"""Prefill role: turns a prompt into KV blocks in the store and the first output token.

A job walks, in order:
  queued (one forward pass at a time) -> prefix lookup in the instance's own prefix cache (its
  paged pool keeps full blocks of earlier jobs, LRU-evicted) -> with `reuse: global`, the rest of
  the cached prefix read from the store -> space for the blocks the store lacks reserved on their
  store nodes (put_start) -> uncached tokens computed in chunks of --prefill-chunk, each layer's
  new K/V written to the store as soon as that layer is computed (--kv-write layer; `after` writes
  whole blocks once the forward is done; `auto` picks) -> first token sampled -> put_end (decode
  may read) -> full blocks kept in the local cache, the rest freed -> the cache's changes reported to the
  conductor -> result. Blocks the store cannot take are left for decode to recompute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from fastapi import Depends, FastAPI, HTTPException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mooncake_server.config import ServerConfig
from mooncake_server.engine.core_budget import machine_cores
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.engine.model_runner import ModelRunner, StepItem
from mooncake_server.engine.sampler import sample_token
from mooncake_server.engine.sequence import Sequence
from mooncake_server.instance.app import Starting, instance_app
from mooncake_server.instance.engine_role import instance_id, start_engine
from mooncake_server.roles.prefill.cache_report import CacheReporter
from mooncake_server.roles.prefill.kv_stream import LayerStream
from mooncake_server.roles.prefill.prefix_cache import LocalPrefixCache
from mooncake_server.store_client.client import StoreError
from mooncake_server.store_client.kv_link import KVStoreLink
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import PrefillJob, PrefillResult
from mooncake_server.wire.routes import PREFILL, serve

log = logging.getLogger(__name__)


class PrefillMetrics:
    """Prometheus series of the prefill role."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter("mooncake_prefill_jobs", "Prefill jobs by outcome", ["outcome"],
                            registry=registry)
        self.computed_tokens = Counter("mooncake_prefill_computed_tokens",
                                       "Prompt tokens computed", registry=registry)
        self.cached_tokens = Counter("mooncake_prefill_cached_tokens",
                                     "Prompt tokens reused (local cache or store)",
                                     registry=registry)
        self.local_tokens = Counter("mooncake_prefill_local_cache_tokens",
                                    "Prompt tokens reused from the instance's own prefix cache",
                                    registry=registry)
        self.cache_blocks = Gauge("mooncake_prefill_cache_blocks",
                                  "KV blocks held in the local prefix cache", registry=registry)
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
        self.cache = LocalPrefixCache(runner.kv)
        self.link = link
        self.executor = executor
        self.config = config
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.reporter: CacheReporter | None = None  # set once the conductor is known
        self._stream: LayerStream | None = None  # the running job's layer-wise writes
        self._lock = asyncio.Lock()
        self.queued = 0

    async def run(self, job: PrefillJob) -> PrefillResult:
        """Prefill one job (serialised with the others)."""
        self.queued += 1
        self.runner.cores.set_active(True)
        try:
            async with self._lock:
                try:
                    return await self._run(job)
                finally:
                    self.metrics.cache_blocks.set(self.cache.num_cached)
                    if self.reporter is not None:
                        # Before the result returns: the conductor plans the next request with
                        # this job's blocks already in its view of this instance.
                        await self.reporter.flush()
        finally:
            self.queued -= 1
            if not self.queued:
                self.runner.cores.set_active(False)

    async def _run(self, job: PrefillJob) -> PrefillResult:
        started = time.perf_counter()
        bt = self.kv.layout.block_tokens
        n = len(job.prompt_token_ids)
        seq = Sequence(job.request_id, list(job.prompt_token_ids), n, job.sampling,
                       self.max_model_len)
        # At least one prompt token must be computed to get logits for the first token.
        reusable = job.block_keys[:(n - 1) // bt]
        hit = self.cache.match(reusable) if job.reuse != "none" else []
        try:
            fresh = self.cache.allocate(self.kv.layout.blocks_for(n) - len(hit))
        except OutOfBlocks:
            self.cache.release(hit)
            raise
        seq.block_ids = hit + fresh
        full = n // bt
        try:
            fetched = 0
            if job.reuse == "global" and len(hit) < len(reusable):
                fetched = await self._load_prefix(reusable[len(hit):], fresh)
            reused = len(hit) + fetched
            seq.num_computed = reused * bt
            tail_key = f"tail/{job.request_id}" if n % bt else None
            keys = job.block_keys[:full] + ([tail_key] if tail_key else [])
            # Blocks fetched from the store are there already; local hits may have left it.
            write = [i for i in range(len(keys)) if not len(hit) <= i < reused]
            first = await self._compute(seq, [keys[i] for i in write], write)
            checksums = await self.link.checksums(seq.block_ids)
            await self._finish_writes(seq, [keys[i] for i in write], write, checksums)
            self.cache.insert(job.block_keys[:full], seq.block_ids[:full])
        finally:
            self.cache.release(seq.block_ids)
        self.metrics.computed_tokens.inc(n - reused * bt)
        self.metrics.cached_tokens.inc(reused * bt)
        self.metrics.local_tokens.inc(len(hit) * bt)
        elapsed = time.perf_counter() - started
        self.metrics.seconds.observe(elapsed)
        return PrefillResult(request_id=job.request_id, first_token=first,
                             cached_tokens=reused * bt, tail_key=tail_key,
                             block_checksums=checksums, prefill_seconds=elapsed,
                             local_cached_tokens=len(hit) * bt)

    async def _compute(self, seq: Sequence, keys: list[str], idx: list[int]) -> int:
        """Forward the uncached tokens chunk by chunk (streaming KV layers); the first token."""
        bt, n = self.kv.layout.block_tokens, len(seq.token_ids)
        self._stream = None
        if self._streams_layers():
            try:
                self._stream = await LayerStream.open(
                    self.link, keys, [seq.block_ids[i] for i in idx],
                    [min((i + 1) * bt, n) for i in idx], seq.num_computed)
            except StoreError as exc:
                log.warning("cannot reserve store space, writing after the forward: %s", exc)
        stream = self._stream
        loop = asyncio.get_running_loop()
        logits: torch.Tensor | None = None
        try:
            while seq.num_pending > 0:
                chunk = min(seq.num_pending, self._chunk_tokens())
                end = seq.num_computed + chunk
                if stream is not None:
                    stream.plan_chunk(end, final=end >= n)
                logits = await loop.run_in_executor(
                    self.executor, self.runner.step, [StepItem(seq, chunk)],
                    stream.on_layer if stream is not None else None)
                if stream is not None:
                    stream.after_chunk()
                seq.num_computed = end
        except BaseException:
            if stream is not None:
                await stream.abort()
            self._stream = None
            raise
        if logits is None:
            raise RuntimeError(f"{seq.request_id}: nothing to compute")  # NOTE: a bug here
        return sample_token(logits[0], seq.sampling, seq.generator)

    def _streams_layers(self) -> bool:
        """--kv-write; `auto` streams layers only where copying does not slow the forward.

        Over TCP or shared memory the engine's threads copy each layer on the CPU; when the
        forward's team already fills every core they preempt it, and every OpenMP region
        waits for its descheduled thread: measured on 2 cores, 1k-token TTFT 0.39-0.41 s
        writing after the forward against 0.49-0.57 s streaming layers.
        """
        mode = self.config.kv_write
        if mode != "auto":
            return mode == "layer"
        threads = self.config.torch_threads
        return self.config.transport == "rdma" or bool(threads and threads < machine_cores())

    def _chunk_tokens(self) -> int:
        """--prefill-chunk, or --decode-chunk while another engine on these cores has work.

        A chunk's thread team is sized when it starts; short chunks let this prefill hand
        cores back soon after a decode beside it wakes (no long oversubscribed stretch).
        """
        if self.runner.cores.others_active():
            return min(self.config.prefill_chunk_tokens, self.config.decode_chunk_tokens)
        return self.config.prefill_chunk_tokens

    async def _finish_writes(self, seq: Sequence, keys: list[str], idx: list[int],
                             checksums: list[int]) -> None:
        """put_end of the streamed blocks, or (no stream) write them whole now."""
        stream, self._stream = self._stream, None
        sums = [checksums[i] for i in idx]
        if stream is not None:
            try:
                stored = await stream.finish(dict(zip(keys, sums)))
                self._note_refused([stored[k] for k in keys])
                return
            except StoreError as exc:
                log.warning("streaming %d KV blocks failed, writing them whole: %s",
                            len(keys), exc)
                self.metrics.store_errors.labels("stream").inc()
        await self._save(keys, [seq.block_ids[i] for i in idx], sums)

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
        self._note_refused(stored)

    def _note_refused(self, stored: list[bool]) -> None:
        if not all(stored):
            log.warning("the store refused %d of %d KV blocks (full); decode recomputes them",
                        stored.count(False), len(stored))
            self.metrics.store_errors.labels("refused").inc()


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
        worker = PrefillWorker(parts.runner, parts.link, parts.executor, config,
                               parts.info.max_model_len, state.metrics)
        worker.reporter = CacheReporter(config.conductor_url or "", instance_id(config),
                                        config.cluster_secret, worker.cache, parts.http)
        state.worker = worker
        info = InstanceInfo(instance_id=instance_id(config), role="prefill", url=config.base_url,
                            model=parts.info.name)
        await starting.join(
            info, busy=lambda: worker.queued > 0, what="prefill jobs",
            load=lambda: Heartbeat(instance_id=instance_id(config), waiting=worker.queued,
                                   free_blocks=worker.cache.num_available))
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
