"""Continuous batching: sequences join and leave between forward passes.

A sequence walks: submit() -> waiting -> running (in every step until it finishes) -> finished.
A request with n > 1 choices submits its first choice only; once that one's prompt is computed
the others fork from it (`_fork`): they share its full prompt blocks (ref-counted here), each gets
a copy of the partial last block, and each samples its own first token from the same logits.
Each step packs every running sequence's next token plus, within `prefill_chunk_tokens`, chunks of
prompts still being prefilled (colocated mode), into ONE forward pass. Block allocation and all
bookkeeping happen on the event loop; only `ModelRunner.step` runs in the executor thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mooncake_server.engine.kv_cache import OutOfBlocks, prompt_cut
from mooncake_server.engine.logprobs import score_prompt_chunks, token_logprob
from mooncake_server.engine.model_runner import ModelRunner, StepItem
from mooncake_server.engine.sampler import sample_token
from mooncake_server.engine.sequence import LATE_FOR_SLO, Produced, SeqStatus, Sequence

log = logging.getLogger(__name__)


class EngineMetrics:
    """Prometheus series of one engine loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batch_size = Histogram(
            "mooncake_engine_batch_size", "Sequences per forward pass", registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.max_batch_size = Gauge(
            "mooncake_engine_max_batch_size", "Largest batch seen so far", registry=registry)
        self.step_seconds = Histogram(
            "mooncake_engine_step_seconds", "Forward pass wall time", registry=registry)
        self.tokens = Counter(
            "mooncake_engine_generated_tokens", "Tokens sampled", registry=registry)
        self.running = Gauge("mooncake_engine_running", "Running sequences", registry=registry)
        self.waiting = Gauge("mooncake_engine_waiting", "Waiting sequences", registry=registry)
        self.free_blocks = Gauge("mooncake_engine_free_kv_blocks", "Free KV blocks",
                                 registry=registry)
        self.computed_prompt_tokens = Counter(
            "mooncake_engine_computed_prompt_tokens", "Prompt tokens computed by forward passes",
            registry=registry)
        self.shared_prompt_tokens = Counter(
            "mooncake_engine_shared_prompt_tokens",
            "Prompt tokens an n > 1 choice took from its first choice instead of computing",
            registry=registry)


class EngineLoop:
    """Owns the running batch of a decode (or colocated) engine."""

    def __init__(self, runner: ModelRunner, executor: ThreadPoolExecutor, metrics: EngineMetrics,
                 max_batch_size: int, prefill_chunk_tokens: int,
                 decode_chunk_tokens: int | None = None) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.executor = executor
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # While sequences decode in a step, its prompt chunk is capped here: the step is their
        # token gap (Sarathi-style chunked prefill).
        self.decode_chunk_tokens = min(decode_chunk_tokens or prefill_chunk_tokens,
                                       prefill_chunk_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._inflight: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._max_seen = 0
        self._block_refs: dict[int, int] = {}  # blocks shared by sibling choices -> holders
        # Told every pure decode step (batch, context tokens, compute seconds, seconds waited
        # for the cores and the forward thread): admission calibration.
        self.step_observer: Callable[[int, int, float, float], None] | None = None
        # Told every pass (prompt tokens, decoding rows, their context tokens, wall seconds) and
        # asked the prompt chunk of a pass beside decoding rows (rows, context): colocated SLO
        # admission measures its passes and keeps them within the TBT SLO.
        self.pass_observer: Callable[[int, int, int, float], None] | None = None
        self.chunk_budget: Callable[[int, int], int] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Stop stepping; unfinished sequences end with an error."""
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for seq in list(self.running) + list(self.waiting):
            self._finish(seq, error="engine shutting down")

    # -- requests --------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; its blocks may already hold `num_computed` tokens of KV."""
        self.waiting.append(seq)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence (client went away); its blocks are freed once no step uses them."""
        if seq.status is SeqStatus.FINISHED:
            return
        seq.finish_reason = "cancelled"
        if seq.request_id not in self._inflight:
            self._finish(seq)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) counts, for heartbeats."""
        return len(self.running), len(self.waiting)

    # -- the loop --------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cores = self.runner.cores
        while True:
            began = time.perf_counter()  # the token gap: the wait for the cores and the pass
            if self.runner.takes_turns and (self.waiting or self.running):
                cores.set_active(True)
                await self._take_turn(loop)
            items = self._schedule()
            if not items:
                self.runner.give_turn()
                cores.set_active(False)
                self._wake.clear()
                await self._wake.wait()
                continue
            cores.set_active(True)
            # A prefill beside this loop holds its next pass until its hand-offs start here.
            cores.note_handed_in(sum(1 for it in items if _first_decode_step(it)))
            ids = {it.seq.request_id for it in items}
            self._inflight |= ids
            try:
                logits = await loop.run_in_executor(self.executor, self.runner.step, items)
                seconds = time.perf_counter() - began
                self.metrics.step_seconds.observe(seconds)
                self._observe(items, seconds)
            except Exception as exc:  # a failed forward fails its batch, not the server
                log.exception("forward pass failed")
                self._inflight -= ids
                for it in items:
                    self._finish(it.seq, error=f"forward pass failed: {exc}")
                continue
            self._inflight -= ids
            self._postprocess(items, logits)

    async def _take_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for the turn on shared cores before picking the batch.

        A sequence submitted while this loop waits (a prefill pass beside it holds the cores)
        joins this step, not the next: picked before the wait, a prefill's hand-off missed it
        and waited another prefill pass and step for its second token.
        """
        try:
            await loop.run_in_executor(self.executor, self.runner.take_turn)
        except asyncio.CancelledError:
            # The wait goes on in the forward thread: hand the turn on once it is taken.
            self.executor.submit(self.runner.give_turn)
            raise

    def _observe(self, items: list[StepItem], seconds: float) -> None:
        if self.pass_observer is not None:
            rows = [it for it in items if it.seq.decoding]
            self.pass_observer(sum(it.num_new for it in items if not it.seq.decoding), len(rows),
                               sum(it.seq.num_computed + 1 for it in rows), seconds)
        if self.step_observer is not None and all(it.seq.decoding for it in items):
            context = sum(it.seq.num_computed + 1 for it in items)
            compute = min(seconds, self.runner.last_compute_s)
            self.step_observer(len(items), context, compute, seconds - compute)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if seq.finish_reason == "cancelled":
                self.waiting.popleft()
                self._finish(seq)
                continue
            need = self.kv.layout.blocks_for(len(seq.token_ids) + 1) - len(seq.block_ids)
            if need > self.kv.num_free:
                break  # wait for running sequences to free blocks
            if need > 0:
                seq.block_ids += self.kv.allocate(need)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _schedule(self) -> list[StepItem]:
        self._admit()
        items: list[StepItem] = []
        # NOTE: decoding rows, not every sequence with one token pending: a burst's one-token
        # prompts read as rows cut its first pass to a TBT-sized chunk, and its 500-700-token
        # prompts ran one after the other beside them (a 734-token one: estimated 2.2 s,
        # measured 6.6 s).
        rows = [seq for seq in self.running if seq.decoding]
        budget = self.decode_chunk_tokens if rows else self.prefill_chunk_tokens
        if rows and self.chunk_budget is not None:
            budget = min(budget, self.chunk_budget(len(rows),
                                                   sum(seq.num_computed + 1 for seq in rows)))
        bt = self.kv.layout.block_tokens
        now = time.perf_counter()
        prompts = 0  # prompt tokens in this pass so far
        for seq in list(self.running):
            n = seq.num_pending
            if not seq.decoding:  # a prompt (chunk) still being prefilled
                if budget <= 0:
                    continue
                if seq.num_computed == 0 and seq.start_by is not None and now > seq.start_by:
                    self._finish(seq, error=LATE_FOR_SLO)  # started now, it would be late
                    continue
                n = prompt_cut(seq.num_computed, n, budget, bt, first=not prompts)
                if not n:
                    continue
                budget -= n
                prompts += n
            try:
                need = -(-(seq.num_computed + n) // bt) - len(seq.block_ids)
                if need > 0:
                    seq.block_ids += self.kv.allocate(need)
            except OutOfBlocks as exc:
                self._finish(seq, error=f"KV cache full: {exc}")
                continue
            items.append(StepItem(seq, n))
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.free_blocks.set(self.kv.num_free)
        return items

    def _postprocess(self, items: list[StepItem], logits: object) -> None:
        batch = len(items)
        self.metrics.batch_size.observe(batch)
        if batch > self._max_seen:
            self._max_seen = batch
            self.metrics.max_batch_size.set(batch)
        assert isinstance(logits, torch.Tensor)
        score_prompt_chunks([(it.seq, it.num_new) for it in items], logits)
        for row, it in enumerate(items):
            seq = it.seq
            if seq.num_computed < seq.prompt_len:
                self.metrics.computed_prompt_tokens.inc(
                    min(seq.num_computed + it.num_new, seq.prompt_len) - seq.num_computed)
            seq.num_computed += it.num_new
            if seq.finish_reason == "cancelled":
                self._finish(seq)
                continue
            if seq.num_pending > 0:
                continue  # more prompt chunks to go
            forks, seq.forks = seq.forks, []
            if forks:
                forks = self._fork(seq, forks)
            for one in [seq, *forks]:
                self._sample(one, logits[row], batch)

    def _sample(self, seq: Sequence, logits: torch.Tensor, batch: int) -> None:
        """Sample `seq`'s next token from its row of `logits` [vocab] and hand it on."""
        try:
            token = sample_token(seq.next_token_logits(logits), seq.sampling, seq.generator)
        except (RuntimeError, ValueError) as exc:  # one bad sequence must not stop the loop
            log.exception("sampling failed for %s", seq.request_id)
            self._finish(seq, error=f"sampling failed: {exc}")
            return
        top = seq.sampling.logprobs
        logprob = None if top is None else token_logprob(logits, token, top)
        seq.token_ids.append(token)
        self.metrics.tokens.inc()
        reason = seq.finish_reason_after(token)
        seq.events.put_nowait(Produced(token, reason, batch, logprob, seq.choice))
        if reason is not None:
            seq.finish_reason = reason
            self._finish(seq)

    def _fork(self, lead: Sequence, forks: list[Sequence]) -> list[Sequence]:
        """The choices still wanted, now running on `lead`'s prompt KV (its prompt is computed).

        Full prompt blocks are shared (never written again: new tokens go after them); the
        partial last block is copied, since each choice writes its own next tokens into it.
        """
        forks = [f for f in forks if f.status is not SeqStatus.FINISHED]
        bt = self.kv.layout.block_tokens
        full, partial = divmod(lead.prompt_len, bt)
        for fork in forks:
            try:
                own = self.kv.allocate(1) if partial else []
            except OutOfBlocks as exc:
                self._finish(fork, error=f"KV cache full: {exc}")
                continue
            if own:
                self.kv.pool[own[0]].copy_(self.kv.pool[lead.block_ids[full]])
            fork.block_ids = lead.block_ids[:full] + own
            fork.shared_blocks = full
            fork.num_computed = lead.num_computed
            fork.prompt_logprobs = lead.prompt_logprobs
            fork.status = SeqStatus.RUNNING
            self.running.append(fork)
            self.metrics.shared_prompt_tokens.inc(lead.prompt_len)
        forks = [f for f in forks if f.status is SeqStatus.RUNNING]
        if forks and full:
            lead.shared_blocks = full
            for block in lead.block_ids[:full]:
                self._block_refs[block] = self._block_refs.get(block, 1) + len(forks)
        return forks

    def _release_blocks(self, seq: Sequence) -> None:
        """Free the blocks `seq` holds; a shared one only once its last holder lets go."""
        shared, own = seq.block_ids[:seq.shared_blocks], seq.block_ids[seq.shared_blocks:]
        for block in shared:
            refs = self._block_refs.pop(block, 1) - 1
            if refs:
                self._block_refs[block] = refs
            else:
                own.append(block)
        self.kv.free(own)
        seq.block_ids, seq.shared_blocks = [], 0

    def _finish(self, seq: Sequence, error: str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if error:
            seq.error = error
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.events.put_nowait(None)
        # Choices never forked (the first one ended before its prompt was computed) end with it.
        forks, seq.forks = seq.forks, []
        for fork in forks:
            fork.finish_reason = fork.finish_reason or seq.finish_reason
            self._finish(fork, error=seq.error or "the request's first choice ended early")
        self.metrics.free_blocks.set(self.kv.num_free)


def _first_decode_step(item: StepItem) -> bool:
    """The step computes a sequence's first token after the one its prefill sampled."""
    seq = item.seq
    return item.num_new == 1 and seq.num_computed == seq.prompt_len == len(seq.token_ids) - 1
