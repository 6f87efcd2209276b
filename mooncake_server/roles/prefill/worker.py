"""The prefill instance's engine side: jobs batched into forward passes, KV written to the store.

A job walks, in order:
  queued -> prefix lookup in the instance's own prefix cache (its paged pool keeps full blocks
  of earlier jobs, LRU-evicted) -> with `reuse: global`, the rest of the cached prefix read from
  the store -> space for the blocks the store lacks reserved on their store nodes (put_start) ->
  uncached tokens computed -> first token sampled (and told to the caller at once: the
  conductor streams it while the rest goes on) -> put_end (decode may read) -> full blocks
  kept in the local cache, the rest freed -> the cache's changes reported to the conductor ->
  result. Blocks the store cannot take are left for decode to recompute.

Jobs that arrive while a pass runs wait; the next batch takes as many of them as fit in one
chunk of --prefill-chunk tokens and computes them in ONE forward pass (a packed batch of
prompts). Served one after another, sixteen 128-token prompts arriving together waited for each
other's whole job (forward, checksums, store writes, cache report) in turn. A prompt longer than
a chunk runs alone, chunk by chunk; passes are sized anew each time, so they shrink to
--decode-chunk while a decode on the same cores has work. A burst's first pass is taken whole
(the conductor sized it by the TTFT SLO), run as chunks back to back and answered when the last
ends, or sooner if holding its computed jobs would make them miss their first token's deadline
(job_queue.py). Each layer's new K/V go to the store as soon as the layer is computed
(--kv-write layer; `after` writes whole blocks once the forward is done; `auto` picks).

A job with `sampling.n` > 1 is prefilled once; each choice's first token is sampled from the
same logits with its own seeded generator (`other_choices`). A job that scores its prompt
(echo: `sampling.prompt_logprobs`) reuses no cached block: the scores need every prompt row's
logits, which a cached block does not keep, so its whole prompt is computed (and its blocks
stored again as usual).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mooncake_server.config import ServerConfig
from mooncake_server.engine.kv_cache import OutOfBlocks
from mooncake_server.engine.logprobs import score_prompt_chunks
from mooncake_server.engine.model_runner import ModelRunner, StepItem
from mooncake_server.engine.sequence import Sequence
from mooncake_server.roles.prefill.cache_report import CacheReporter
from mooncake_server.roles.prefill.chunk_budget import ChunkBudget
from mooncake_server.roles.prefill.first_tokens import first_tokens
from mooncake_server.roles.prefill.hand_on import Answer, HandOn
from mooncake_server.roles.prefill.job_queue import (
    JobQueue,
    LateForSLO,
    Waiting,
    first_pass_late,
    forward_shares,
    joins_forward,
    same_first_pass,
    tail_late,
)
from mooncake_server.roles.prefill.kv_stream import LayerStream
from mooncake_server.roles.prefill.metrics import PrefillMetrics
from mooncake_server.roles.prefill.prefix_cache import LocalPrefixCache
from mooncake_server.roles.prefill.store_io import finish_writes, load_prefix, streams_layers
from mooncake_server.roles.prefill.task import PrefillTask
from mooncake_server.store_client.client import StoreError
from mooncake_server.store_client.kv_link import KVStoreLink
from mooncake_server.wire.instances import PassSplit
from mooncake_server.wire.jobs import FirstToken, PrefillFirst, PrefillJob, PrefillResult

log = logging.getLogger(__name__)


class PrefillWorker:
    """Runs prefill jobs over one model and one KV pool, queued jobs batched per forward pass."""

    def __init__(self, runner: ModelRunner, link: KVStoreLink, executor: ThreadPoolExecutor,
                 config: ServerConfig, max_model_len: int, metrics: PrefillMetrics,
                 chunks: ChunkBudget | None = None) -> None:
        self.runner = runner
        self.chunks = chunks or ChunkBudget(config.decode_chunk_tokens)
        self.kv = runner.kv
        self.cache = LocalPrefixCache(runner.kv)
        self.link = link
        self.executor = executor
        self.config = config
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.reporter: CacheReporter | None = None  # set once the conductor is known
        self._queue = JobQueue()
        self._pushed = asyncio.Event()  # a job joined the queue
        self._serving: asyncio.Task[None] | None = None
        self.queued = 0
        self._hand_on = HandOn(runner.cores, metrics.held_handoffs, link.remove)

    async def run(self, job: PrefillJob,
                  on_first: Callable[[PrefillFirst], None] | None = None) -> PrefillResult:
        """Prefill one job (batched with the jobs queued beside it); `on_first` is told its
        first tokens as soon as its prompt is computed, before its KV is in the store."""
        task = PrefillTask(job, asyncio.get_running_loop().create_future(), on_first=on_first)
        self.queued += 1
        self.runner.cores.set_active(True)
        self._queue.push(task)
        self._pushed.set()
        if self._serving is None or self._serving.done():
            # NOTE: the queue is served by its own task: a caller that goes away (its request
            # cancelled) must not stop the pass computing the others' jobs.
            self._serving = asyncio.create_task(self._serve(), name="prefill-batches")
        try:
            return await task.done
        finally:
            self.queued -= 1
            if not self.queued:
                self.runner.cores.set_active(False)
                # NOTE: the hand-off grace is for jobs already waiting when one is answered; a
                # prompt that comes later (the next turn of a chat) runs at full speed.
                self._hand_on.idle()

    async def _serve(self) -> None:
        """Batches until the queue is empty; then the held hand-offs go on."""
        try:
            await self._serve_queue()
        finally:
            self._hand_on.due(None)

    async def _serve_queue(self) -> None:
        while self._queue:
            self._pushed.clear()
            batch = self._take_batch()
            if not batch:
                if self._queue.hold_s > 0:  # the head waits for its burst's earlier ranks
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._pushed.wait(), self._queue.hold_s)
                continue
            try:
                await self._run_batch(batch)
            except Exception as exc:  # noqa: BLE001 - a bug must not leave callers waiting
                log.exception("prefill batch failed")
                await self._fail_all(batch, exc)

    def _take_batch(self) -> list[PrefillTask]:
        """The next job in the admission's order, and those after it whose prompts fit in the
        same chunk; jobs that waited past their start deadline are refused (429)."""
        batch, late = self._queue.take(self._chunk_tokens(), self._still_in_time, self._packs)
        for task in late:
            assert isinstance(task, PrefillTask)
            waited = time.perf_counter() - task.queued_at
            log.info("refusing %s: waited %.2f s, past the %.2f s its TTFT SLO allowed",
                     task.job.request_id, waited, task.job.start_within_s)
            self._fail(task, LateForSLO(
                f"prefill could not start within {task.job.start_within_s:.2f} s "
                f"(waited {waited:.2f} s): it would miss its TTFT SLO"))
        return [t for t in batch if isinstance(t, PrefillTask)]

    def _packs(self, tasks: list[Waiting]) -> bool:
        """Whether the last of `tasks` joins the forward of those before it, at the speed full
        passes ran here lately (job_queue.joins_forward)."""
        sizes = [(len(t.job.prompt_token_ids), 0) for t in tasks]
        with_s, without_s = self.chunks.rest_s(sizes), self.chunks.rest_s(sizes[:-1])
        if with_s is None or without_s is None:
            return True
        return joins_forward([t.expect_by for t in tasks if isinstance(t, PrefillTask)], with_s,
                             with_s - without_s, self.chunks.rest_s([(1, 0)]) or 0.0,
                             time.perf_counter())

    def _still_in_time(self, task: Waiting) -> bool:
        """Whether a job past its start deadline, started now and alone, would still end by
        its first token's deadline at the speed passes here ran lately, `TAIL_DRIFT` slower
        (job_queue.py; no speed timed, no deadline: it would not)."""
        assert isinstance(task, PrefillTask)
        due = task.answer_by
        run_s = self.chunks.prompt_s(len(task.job.prompt_token_ids), self._beside_decode(),
                                     self.runner.cores.others_step_s())
        now = time.perf_counter()
        if due is None or run_s is None or tail_late([due], run_s, now):
            return False
        self.metrics.late_started.inc()
        log.info("starting %s past the start its TTFT SLO allowed (%.2f s after it came): at "
                 "the speed passes here ran lately it ends in an estimated %.2f s, %.2f s before "
                 "its first token is due", task.job.request_id, now - task.queued_at, run_s,
                 due - now - run_s)
        return True

    async def _run_batch(self, batch: list[PrefillTask]) -> None:
        """Prepare the batch, then step it; each job is answered once its prompt is computed."""
        # Store reads and reservations of the batch's jobs are independent: all in flight at once.
        prepared = await asyncio.gather(*(self._prepare(t) for t in batch), return_exceptions=True)
        pending: list[PrefillTask] = []
        for task, outcome in zip(batch, prepared):
            if outcome is None:
                pending.append(task)
            else:  # handed to that job's caller
                self._fail(task, outcome)
        cancelled = [o for o in prepared if o is not None and not isinstance(o, Exception)]
        if cancelled:  # the worker is shutting down
            await self._fail_all(pending, cancelled[0])
            raise cancelled[0]
        if pending:
            self.metrics.batch_jobs.observe(len(pending))
        # A burst's first pass is answered whole when its last forward ends (job_queue.py).
        one_pass = len(pending) > 1 and all(same_first_pass(pending[0].job, t.job)
                                            for t in pending)
        held: list[tuple[PrefillTask, list[FirstToken]]] = []
        while pending:
            try:
                done = await self._step(pending)
            except BaseException as exc:  # noqa: BLE001 - every job of the pass failed with it
                await self._fail_all([*pending, *(t for t, _ in held)], exc)
                if not isinstance(exc, Exception):
                    raise
                return
            pending = [t for t in pending if t.seq is not None and t.seq.num_pending > 0]
            held += done
            if one_pass and pending and all(t.job.pass_tail and not t.passes for t in pending):
                pending = await self._tail_in_time(pending, held)
            if not (one_pass and pending) or self._held_would_miss(held, pending):
                behind = sum(t.seq.num_pending for t in pending if t.seq is not None)
                await self._answer(held, behind + self._queue.tokens())
                held = []

    def _held_would_miss(self, held: list[tuple[PrefillTask, list[FirstToken]]],
                         pending: list[PrefillTask]) -> bool:
        """Whether a first pass's jobs computed so far would miss their first token's deadline
        if held for the rest of the pass (job_queue.first_pass_late)."""
        if not held or not pending:
            return False
        rest = self.chunks.rest_s([(t.seq.num_pending, t.seq.num_computed)
                                   for t in pending if t.seq is not None])
        late = first_pass_late([t.answer_by for t, _ in held], rest, time.perf_counter())
        if late > 0:
            log.info("answering %d jobs of a first pass before its end: the rest would take an "
                     "estimated %.2f s, %.2f s past their first token's deadline", len(held),
                     rest, late)
        return late > 0

    async def _tail_in_time(self, tails: list[PrefillTask],
                            held: list[tuple[PrefillTask, list[FirstToken]]]) -> list[PrefillTask]:
        """A first pass's tail if, at the speed the pass ran, it ends within its deadline and
        the held jobs'; otherwise turned away before any work (job_queue.tail_late)."""
        rest = self.chunks.rest_s([(t.seq.num_pending, t.seq.num_computed)
                                   for t in tails if t.seq is not None])
        late = tail_late([t.answer_by for t in tails] + [t.answer_by for t, _ in held], rest,
                         time.perf_counter())
        if not late:
            return tails
        log.info("refusing %s, the tail of a first pass: at the speed the pass ran it would end "
                 "%.2f s past its deadline", ", ".join(t.job.request_id for t in tails), late)
        await self._fail_all(tails, LateForSLO(
            f"the prefill's first pass ran late: its last prompt would miss its TTFT SLO by "
            f"{late:.2f} s, so it was not started"))
        return []

    async def _step(self, pending: list[PrefillTask]) -> list[tuple[PrefillTask, list[FirstToken]]]:
        """One forward pass over the oldest pending tokens, within one chunk; who completed.

        The chunk is sized per pass (`_chunk_tokens`): once a decode beside this prefill
        wakes, the passes after it shrink, and each sizes its thread team anew.
        """
        items: list[tuple[PrefillTask, StepItem]] = []
        shares = self._pass_shares(pending)
        for task, chunk in zip(pending, shares):
            seq = task.seq
            assert seq is not None  # _prepare gave it one
            if not chunk:
                continue
            end = seq.num_computed + chunk
            if task.stream is not None:
                task.stream.plan_chunk(end, final=end >= len(seq.token_ids))
            items.append((task, StepItem(seq, chunk)))
        streams = [t.stream for t, _ in items if t.stream is not None]

        def on_layer(layer: int) -> None:
            for stream in streams:
                stream.on_layer(layer)

        self.metrics.handoff_hold.inc(await self._hand_on.hold.wait())
        beside_decode = self._beside_decode()
        logits = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.runner.step, [it for _, it in items],
            on_layer if streams else None)
        self.chunks.observe([(it.num_new, it.seq.num_computed) for _, it in items],
                            self.runner.last_compute_s, self.runner.last_wait_s, beside_decode)
        for task, _ in items:
            task.passes += 1
            task.compute_s += self.runner.last_compute_s
            task.wait_s += self.runner.last_wait_s
        for stream in streams:
            stream.after_chunk()
        score_prompt_chunks([(it.seq, it.num_new) for _, it in items], logits)
        done = []
        for row, (task, item) in enumerate(items):
            item.seq.num_computed += item.num_new
            if item.seq.num_pending == 0:
                done.append((task, first_tokens(task.job, item.seq, logits[row])))
        return done

    async def _answer(self, done: list[tuple[PrefillTask, list[FirstToken]]],
                      behind_tokens: int = 0) -> None:
        """Finish the completed jobs, report the cache's changes, then answer their callers,
        or hold the hand-on of those whose decode would cut the `behind_tokens` prompt tokens
        still queued (hand_on.py)."""
        if not done:
            return
        bt = self.kv.layout.block_tokens
        told = []
        for task, firsts in done:
            assert task.seq is not None
            first = PrefillFirst(first_token=firsts[0].token_id, cached_tokens=task.reused * bt,
                                 first_logprob=firsts[0].logprob,
                                 prompt_logprobs=task.seq.prompt_logprobs,
                                 other_choices=firsts[1:])
            if task.on_first is not None and not task.done.done():
                task.on_first(first)
            told.append(first)
        # The jobs' checksums and store writes are independent: all in flight at once.
        outcomes = await asyncio.gather(*(self._finish(task, first)
                                          for (task, _), first in zip(done, told)),
                                        return_exceptions=True)
        self.metrics.cache_blocks.set(self.cache.num_cached)
        if self.reporter is not None:
            # Before the results return: the conductor plans the next request with these
            # jobs' blocks already in its view of this instance.
            await self.reporter.flush()
        answers = []
        for (task, _), outcome in zip(done, outcomes):
            if isinstance(outcome, PrefillResult):  # its caller may be gone: hand_on.py
                sampling = task.job.sampling
                answers.append(Answer(task.done, outcome,
                                      sampling.n if sampling.max_tokens > 1 else 0,
                                      task.answer_by))
            elif task.done.done():
                continue
            elif isinstance(outcome, Exception):
                task.done.set_exception(outcome)
            else:
                raise outcome  # cancelled: the worker is shutting down
        self._hand_on.send(answers, behind_tokens,
                           self.chunks.tokens(self.runner.cores.others_step_s()))

    def _pass_shares(self, pending: list[PrefillTask]) -> list[int]:
        """The prompt tokens each pending job computes in the next pass (`_chunk_tokens`); held
        hand-offs due before that pass would end go on first, and it is cut beside them."""
        bt = self.kv.layout.block_tokens
        sizes = [(t.seq.num_pending, t.job.pass_tail and not t.passes, t.seq.num_computed)
                 if t.seq is not None else (0, False, 0) for t in pending]
        shares = forward_shares(sizes, self._chunk_tokens(), bt)
        if len(self._hand_on) and self._hand_on.due(self.chunks.rest_s(
                [(n, t.seq.num_computed) for t, n in zip(pending, shares)
                 if n and t.seq is not None])):
            shares = forward_shares(sizes, self._chunk_tokens(), bt)
        return shares

    async def _fail_all(self, tasks: list[PrefillTask], exc: BaseException) -> None:
        """Abort the store reservations of unanswered jobs, then fail them with `exc`."""
        for task in tasks:
            stream, task.stream = task.stream, None
            if stream is not None:  # finished jobs handed theirs on already
                try:
                    await stream.abort()
                except Exception as abort_exc:  # noqa: BLE001 - the leases expire on their own
                    log.warning("giving back %s's store reservations failed: %s",
                                task.job.request_id, abort_exc)
            self._fail(task, exc)

    def _fail(self, task: PrefillTask, exc: BaseException) -> None:
        """Free what the job holds and hand `exc` to its caller."""
        if task.seq is not None and task.seq.block_ids:
            self.cache.release(task.seq.block_ids)
            task.seq.block_ids = []
        if not task.done.done():
            task.done.set_exception(exc if isinstance(exc, Exception)
                                    else RuntimeError("prefill interrupted"))

    async def _prepare(self, task: PrefillTask) -> None:
        """Blocks for the job: local cache hits, store reads, fresh ones; the layer stream."""
        job, bt = task.job, self.kv.layout.block_tokens
        task.started = time.perf_counter()
        n = len(job.prompt_token_ids)
        seq = Sequence(job.request_id, list(job.prompt_token_ids), n, job.sampling,
                       self.max_model_len)
        # At least one prompt token must be computed to get logits for the first token.
        reusable = job.block_keys[:(n - 1) // bt]
        reuse = job.reuse
        if job.sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
            reuse = "none"  # scoring needs every prompt row's logits (see the module docstring)
        hit = self.cache.match(reusable) if reuse != "none" else []
        try:
            fresh = self.cache.allocate(self.kv.layout.blocks_for(n) - len(hit))
        except OutOfBlocks:
            self.cache.release(hit)
            raise
        seq.block_ids = hit + fresh
        task.seq, task.hit = seq, len(hit)
        fetched = 0
        if reuse == "global" and len(hit) < len(reusable):
            fetched = await load_prefix(self.link, self.metrics, reusable[len(hit):], fresh)
        task.reused = len(hit) + fetched
        seq.num_computed = task.reused * bt
        full = n // bt
        task.tail_key = f"tail/{job.request_id}" if n % bt else None
        keys = job.block_keys[:full] + ([task.tail_key] if task.tail_key else [])
        # Blocks fetched from the store are there already; local hits may have left it.
        task.write = [i for i in range(len(keys)) if not len(hit) <= i < task.reused]
        task.keys = [keys[i] for i in task.write]
        if streams_layers(self.config):
            try:
                task.stream = await LayerStream.open(
                    self.link, task.keys, [seq.block_ids[i] for i in task.write],
                    [min((i + 1) * bt, n) for i in task.write], seq.num_computed)
            except StoreError as exc:
                log.warning("cannot reserve store space, writing after the forward: %s", exc)

    async def _finish(self, task: PrefillTask, first: PrefillFirst) -> PrefillResult:
        """Checksums, the store writes committed, full blocks kept in the local cache."""
        seq, bt = task.seq, self.kv.layout.block_tokens
        assert seq is not None
        n = len(seq.token_ids)
        try:
            checksums = await self.link.checksums(seq.block_ids)
            stream, task.stream = task.stream, None
            await finish_writes(self.link, self.metrics, stream, task.keys,
                                [seq.block_ids[i] for i in task.write],
                                [checksums[i] for i in task.write])
            self.cache.insert(task.job.block_keys[:n // bt], seq.block_ids[:n // bt])
        finally:
            self.cache.release(seq.block_ids)
            seq.block_ids = []
        self.metrics.computed_tokens.inc(n - task.reused * bt)
        self.metrics.cached_tokens.inc(task.reused * bt)
        self.metrics.local_tokens.inc(task.hit * bt)
        elapsed = time.perf_counter() - task.started
        self.metrics.seconds.observe(elapsed)
        # Where a slow TTFT went: queued, computing, or waiting for a decode's steps.
        log.info("prefilled %s: %d of %d tokens in %d passes, %.2f s after %.2f s queued "
                 "(compute %.2f s, waits for the cores %.2f s)", task.job.request_id,
                 n - task.reused * bt, n, task.passes, elapsed, task.started - task.queued_at,
                 task.compute_s, task.wait_s)
        return PrefillResult(**dict(first), request_id=task.job.request_id,
                             tail_key=task.tail_key, block_checksums=checksums,
                             prefill_seconds=elapsed, local_cached_tokens=task.hit * bt)

    def pass_split(self) -> PassSplit | None:
        """How a prompt is computed here (heartbeats; None without --tbt-slo)."""
        cores = self.runner.cores
        return self.chunks.split(bool(cores.others_present()), self.config.prefill_chunk_tokens,
                                 cores.others_step_s())

    def _beside_decode(self) -> bool:
        return self._hand_on.beside_decode()

    def _chunk_tokens(self) -> int:
        """--prefill-chunk, or while another engine on these cores has work (or is about to
        take a job just answered), the chunk that keeps its token gaps short (--decode-chunk;
        with --tbt-slo, sized to fit it).

        A chunk's thread team is sized when it starts; short chunks let this prefill hand
        cores back soon after a decode beside it wakes (no long oversubscribed stretch).
        """
        if self._beside_decode():
            return min(self.config.prefill_chunk_tokens,
                       self.chunks.tokens(self.runner.cores.others_step_s()))
        return self.config.prefill_chunk_tokens
