"""Decode role: loads a prefilled request's KV from the store and decodes it in a continuous batch.

A request walks, in order:
  blocks reserved in the local paged cache -> prompt KV read from the store (full blocks by chained
  key, then the partial tail block, from any live replica) and checksums verified; blocks the
  store no longer holds, or holds in another writer's copy, are left to recompute -> waiting ->
  running in the engine loop (one token per step, sharing forward passes with every other
  running request) -> finished; each token is streamed back to the conductor as one NDJSON
  line. A closed stream cancels the request and frees its blocks.
A request moved here from another decode instance (its job carries the output so far) loads every
full block of its computed tokens the store holds and recomputes the rest before its next token.
Every block that fills is written back to the store under its chained key (engine/writeback.py),
so a moved request or a follow-up turn finds it. SIGTERM drains: the conductor is told to send
nothing new, running streams finish (at most --drain-timeout), then the process exits.
Admission control (scheduler/admission.py): the conductor reserves room before the prefill
(POST /internal/decode/reserve); the decode job claims it; the stream's end releases it. A request
the KV memory or predicted TBT cannot take is refused with 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.loading import load_perf_model
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.engine.sequence import SeqStatus, Sequence
from mooncake_server.instance.app import Starting, instance_app
from mooncake_server.instance.engine_role import (
    after_neighbours_load,
    instance_id,
    start_engine,
)
from mooncake_server.roles.decode.admission import AdmissionRefused, DecodeAdmission
from mooncake_server.roles.decode.writeback import BlockWriteBack, WriteBackLoop, WriteBackMetrics
from mooncake_server.store_client.client import StoreError
from mooncake_server.store_client.kv_link import KVStoreLink
from mooncake_server.transfer import TransferError
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import (
    DecodeEvent,
    DecodeJob,
    DecodeRelease,
    DecodeReserve,
    DecodeReserveReply,
    ErrorEvent,
)
from mooncake_server.wire.routes import DECODE, DECODE_RELEASE, DECODE_RESERVE, serve

log = logging.getLogger(__name__)

# One-token passes timed at start-up; the fastest is the quiet step admission falls back on.
_QUIET_PASSES = 5


class DecodeService:
    """Admits decode jobs: loads their KV, hands them to the engine loop, streams their tokens."""

    def __init__(self, loop: EngineLoop, link: KVStoreLink, max_model_len: int,
                 failures: Counter, verified: Counter, recomputed: Counter,
                 mismatched: Counter) -> None:
        self.loop = loop
        self.kv = loop.kv
        self.link = link
        self.max_model_len = max_model_len
        self.failures = failures
        self.verified = verified
        self.recomputed = recomputed
        self.mismatched = mismatched
        self.admission: DecodeAdmission | None = None
        self.writeback: BlockWriteBack | None = None
        self.streams = 0  # token streams open (a drain waits for them)

    def _claim(self, job: DecodeJob) -> None:
        """Admission: take over the job's reservation or admit it now (AdmissionRefused)."""
        if self.admission is not None:
            self.admission.claim(job.request_id, len(job.prompt_token_ids),
                                 job.sampling.max_tokens)

    def _release(self, request_id: str) -> None:
        if self.admission is not None:
            self.admission.release(request_id)

    async def admit(self, job: DecodeJob) -> Sequence:
        """Load the job's KV and queue it; raises AdmissionRefused, StoreError, TransferError or
        OutOfBlocks."""
        self._claim(job)
        try:
            seq = await self._load_and_submit(job)
        except BaseException:
            self._release(job.request_id)
            raise
        if self.admission is not None:
            self.admission.bind(job.request_id, lambda: seq.status is SeqStatus.FINISHED)
        return seq

    async def _load_and_submit(self, job: DecodeJob) -> Sequence:
        bt = self.kv.layout.block_tokens
        n = len(job.prompt_token_ids)
        tokens = [*job.prompt_token_ids, job.first_token, *job.generated_token_ids]
        m = len(tokens) - 1  # tokens whose KV must be cached before the next token (n, unless moved)
        seq = Sequence(job.request_id, tokens, n, job.sampling, self.max_model_len)
        seq.block_ids = self.kv.allocate(self.kv.layout.blocks_for(m))
        try:
            keys = job.block_keys[:m // bt] + ([job.tail_key] if job.tail_key else [])
            try:
                got = await self.link.load(keys, seq.block_ids)
            except StoreError as exc:
                log.warning("loading KV of %s failed, recomputing it: %s", job.request_id, exc)
                got = 0
            if got and job.block_checksums:
                got = await self._verified(job, seq.block_ids[:got])
        except BaseException:
            self.kv.free(seq.block_ids)
            seq.block_ids = []
            raise
        if job.tail_key and job.drop_tail:
            # The tail block is private to this request: drop it from the store once we hold it.
            asyncio.create_task(self._drop_tail(job))
        # NOTE: blocks the store lost (a dead node without replicas, a refused put) are
        # recomputed by the engine loop as prompt chunks before the next token: never a failure.
        seq.num_computed = min(got * bt, m)
        if got < len(keys):
            self.recomputed.inc(m - seq.num_computed)
        self._track(job, seq, min(got, m // bt))
        self.loop.submit(seq)
        return seq

    async def _verified(self, job: DecodeJob, block_ids: list[int]) -> int:
        """How many leading loaded blocks hold the bytes the prefill computed (CRC32C)."""
        sums = await self.link.checksums(block_ids)
        bad = next((i for i, (a, b) in enumerate(zip(sums, job.block_checksums)) if a != b),
                   len(sums))
        self.verified.inc(bad)
        if bad < len(sums):
            # NOTE: the store checked these bytes against their writer's checksum; the writer
            # was another request sharing the prefix whose passes ran in other shapes (a block's
            # bits depend on them, engine/kv_cache.prompt_cut), and the store keeps the first
            # copy of a key. Recomputed here from the first such block, the answer is this
            # request's own; refused, it was a 503 for a healthy cluster.
            log.warning("KV of %s: block %d of %d is another writer's copy, recomputing from it",
                        job.request_id, bad, len(sums))
            self.mismatched.inc(len(sums) - bad)
        return bad

    def _track(self, job: DecodeJob, seq: Sequence, stored: int) -> None:
        """Write back the blocks that fill from here on; count a moved-in request's loaded KV."""
        if self.writeback is None:
            return
        if job.generated_token_ids:
            self.writeback.metrics.moved_in.inc()
            self.writeback.metrics.moved_in_loaded.inc(seq.num_computed)
        if job.kv_namespace is not None:
            bt = self.kv.layout.block_tokens
            self.writeback.track(seq, job.kv_namespace,
                                 job.block_keys[:(len(seq.token_ids) - 1) // bt], stored)

    async def _drop_tail(self, job: DecodeJob) -> None:
        try:
            await self.link.remove([job.tail_key or ""])
        except Exception as exc:  # the store's LRU reclaims it anyway
            log.warning("could not remove tail block %s: %s", job.tail_key, exc)

    async def stream(self, seq: Sequence, first_index: int = 1) -> AsyncIterator[bytes]:
        """NDJSON lines of DecodeEvent / ErrorEvent until the sequence finishes; the first
        token streamed is output token `first_index`."""
        index = first_index
        self.streams += 1
        try:
            while True:
                ev = await seq.events.get()
                if ev is None:
                    if seq.error:
                        self.failures.labels("engine").inc()
                        yield ErrorEvent(error=seq.error).model_dump_json().encode() + b"\n"
                    return
                yield DecodeEvent(token_id=ev.token_id, finish_reason=ev.finish_reason,
                                  batch_size=ev.batch_size, index=index,
                                  logprob=ev.logprob).model_dump_json().encode() + b"\n"
                index += 1
        finally:
            self.streams -= 1
            self.loop.cancel(seq)  # no-op if finished; frees blocks if the client went away
            self._release(seq.request_id)


@dataclass
class DecodeState:
    """What the decode routes read: the failure counter, and the service once started."""

    failures: Counter
    service: DecodeService | None = None

    def running(self) -> DecodeService:
        """The service (only None before start-up, when uvicorn serves no request)."""
        if self.service is None:
            raise HTTPException(503, "decode instance is starting")
        return self.service

    def admission(self) -> DecodeAdmission:
        """The running service's admission control."""
        admission = self.running().admission
        if admission is None:  # NOTE: the lifespan sets it before serving
            raise HTTPException(503, "decode instance is starting")
        return admission


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
                         "Prompt tokens whose KV the store no longer held (or held another "
                         "writer's copy of), recomputed here",
                         registry=registry)
    mismatched = Counter("mooncake_decode_kv_blocks_mismatched",
                         "KV blocks read from the store whose CRC32C was not prefill's (another "
                         "writer's copy of a shared prefix), recomputed here", registry=registry)
    writeback_metrics = WriteBackMetrics(registry)
    state = DecodeState(failures)

    async def start(starting: Starting) -> None:
        parts = await start_engine(starting, "decode")
        runner = parts.runner
        writeback = BlockWriteBack(runner.kv, parts.link, writeback_metrics)
        starting.stack.push_async_callback(writeback.close, config.transfer_timeout_s)
        loop = WriteBackLoop(runner, parts.executor, engine_metrics, config.max_batch_size,
                             config.prefill_chunk_tokens, config.decode_chunk_tokens,
                             writeback=writeback)
        loop.start()
        starting.stack.push_async_callback(loop.stop)
        service = DecodeService(loop, parts.link, parts.info.max_model_len, failures, verified,
                                recomputed, mismatched)
        service.admission = _admission(config, runner.kv.num_blocks, parts.info.max_model_len)
        if service.admission.model is not None:
            await after_neighbours_load(runner.cores)
            quiet = await asyncio.get_running_loop().run_in_executor(
                parts.executor, runner.quiet_step_s, _QUIET_PASSES)
            service.admission.seed_quiet_step(1, _QUIET_PASSES, quiet)
            log.info("quiet decode step %.1f ms: %.2fx the cost model's", quiet * 1000,
                     quiet / service.admission.model.decode_step_s(1, _QUIET_PASSES))
        service.writeback = writeback
        loop.step_observer = service.admission.observe_step
        state.service = service
        info = InstanceInfo(instance_id=instance_id(config), role="decode", url=config.base_url,
                            model=parts.info.name)
        await starting.join(
            info, busy=lambda: service.streams > 0 or any(loop.load), what="decode streams",
            load=lambda: _heartbeat(instance_id(config), loop, runner.kv.num_free,
                                    service.admission))
        log.info("decode instance %s ready", instance_id(config))

    app = instance_app(config, "mooncake-server decode", registry, start)
    guard = Depends(require_secret(config.cluster_secret))

    @serve(app, DECODE, dependencies=[guard])
    async def decode(job: DecodeJob) -> StreamingResponse:
        """Load a prefilled request and stream its remaining tokens as NDJSON."""
        service = state.running()
        try:
            seq = await service.admit(job)
        except AdmissionRefused as exc:
            failures.labels("refused").inc()
            raise HTTPException(503, f"decode admission refused: {exc}") from exc
        except OutOfBlocks as exc:
            failures.labels("no_kv_memory").inc()
            raise HTTPException(503, f"decode KV cache full: {exc}") from exc
        except (StoreError, TransferError) as exc:
            failures.labels("kv_load").inc()
            raise HTTPException(503, f"loading KV from the store failed: {exc}") from exc
        return StreamingResponse(service.stream(seq, 1 + len(job.generated_token_ids)),
                                 media_type="application/x-ndjson")

    @serve(app, DECODE_RESERVE, dependencies=[guard])
    async def reserve(body: DecodeReserve) -> DecodeReserveReply:
        """Admission before prefill: hold room for a request, or 503 if KV / TBT do not allow."""
        admission = state.admission()
        try:
            admission.reserve(body.request_id, body.prompt_tokens, body.max_tokens)
        except AdmissionRefused as exc:
            failures.labels("refused").inc()
            raise HTTPException(503, f"decode admission refused: {exc}") from exc
        return DecodeReserveReply(ttl_s=admission.ttl_s)

    @serve(app, DECODE_RELEASE, dependencies=[guard])
    async def release(body: DecodeRelease) -> dict[str, bool]:
        """Drop a reservation whose decode job will not come."""
        state.admission().release(body.request_id)
        return {"released": True}

    return app


def _heartbeat(iid: str, loop: WriteBackLoop, free_blocks: int,
               admission: DecodeAdmission) -> Heartbeat:
    """Load, and with a cost model, how this instance's steps compare with it."""
    timed = admission.model is not None
    ratio, wait = admission.gap_split()
    return Heartbeat(instance_id=iid, running=loop.load[0], waiting=loop.load[1],
                     free_blocks=free_blocks,
                     step_ratio=ratio if timed else None,
                     step_ratio_mean=admission.mean_step_ratio() if timed else None,
                     wait_s=wait if timed else None)


def _admission(config: ServerConfig, total_blocks: int, max_model_len: int) -> DecodeAdmission:
    """Admission control over this instance's pool; TBT checked only with --tbt-slo."""
    model = (load_perf_model(config.profile_path, config.block_tokens, config.dtype)
             if config.tbt_slo_s is not None else None)
    return DecodeAdmission(total_blocks, config.block_tokens, max_model_len, model=model,
                           tbt_slo_s=config.tbt_slo_s)
