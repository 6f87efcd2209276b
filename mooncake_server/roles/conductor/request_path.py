"""The conductor's `Backend`: one request across a prefill instance, the store and a decode instance.

A request walks, in order (each step one method below):
  keyed (the prompt's chained block keys, hashed once) ->
  planned (`KVCacheScheduler.plan`: one prefix query over the store index and the prefill
    instances' own caches, Algorithm 1's TTFT / TBT estimates; 429 at once if no pair meets
    the SLOs; the plan is a value this request carries) ->
  reserved (decode admission on the planned decode instance, or the next one the scheduler
    offers; 429 if none will) ->
  prefilling (`RequestMoves.prefill`: the job on the planned prefill instance, re-sent on a
    fault; the prompt's KV lands in the store), its first token yielded as soon as the prefill
    instance has computed the prompt, before the store writes (a re-sent prefill keeps the
    first tokens already streamed) ->
  decoding (`RequestMoves.decode`: the decode instance's NDJSON stream, moved on a fault or an
    ordered migration) -> finished.
With n > 1 choices the prompt is prefilled once (the prefill samples every choice's first
token); then each choice decodes as its own flow on the stored prompt KV, their tokens merged
into one stream. Choice 0 is the request's own flow (reservation, migration); the others are
admitted by a decode instance when their job arrives, and the partial tail block they all read
is removed by the conductor at the end instead of by the first decode instance to load it.
Whatever the outcome, the end releases what the request held: the scheduler's ledger entry, an
unclaimed decode reservation, and the partial tail block if no decode instance took it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from typing import Any

import httpx

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.block_keys import block_keys_async, kv_namespace
from mooncake_server.config import ServerConfig
from mooncake_server.model_assets import served_name
from mooncake_server.roles.conductor.admission_client import release_decode_later, reserve_decode
from mooncake_server.roles.conductor.flow import DECODE, RequestFlow
from mooncake_server.roles.conductor.instance_calls import InstanceCalls
from mooncake_server.roles.conductor.master_link import MasterLink
from mooncake_server.roles.conductor.moves import MoveStats, RequestMoves
from mooncake_server.roles.conductor.registry import INSTANCE_ROLES, InstanceRegistry
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler
from mooncake_server.roles.conductor.watch import least_loaded
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.jobs import FirstToken, PrefillFirst, PrefillResult, SamplingParams
from mooncake_server.wire.moves import MigrateReply, RunningRequest

log = logging.getLogger(__name__)


class RequestPath:
    """Backend that runs each request on a prefill instance, the store and a decode instance."""

    def __init__(self, config: ServerConfig, registry: InstanceRegistry, http: httpx.AsyncClient,
                 scheduler: KVCacheScheduler, store_master: MasterLink) -> None:
        self.scheduler = scheduler
        self.store_master = store_master
        self.namespace = kv_namespace(
            served_name(config.model, config.served_model_name), config.dtype, config.block_tokens)
        self.stats = MoveStats()
        self._config = config
        self._registry = registry
        self._http = http
        self._headers = secret_headers(config.cluster_secret)
        self._calls = InstanceCalls(http, self._headers,
                                    httpx.Timeout(config.request_timeout_s, connect=5.0),
                                    registry, store_master, self.stats,
                                    config.heartbeat_timeout_s)
        self._moves = RequestMoves(config, registry, self.namespace, self.stats,
                                   scheduler.follow_decode)
        self._flows: dict[str, RequestFlow] = {}
        self._background: set[asyncio.Task[object]] = set()

    def ready(self) -> bool:
        """True when at least one prefill, decode and store instance is alive (store nodes
        of a standalone master are its to watch, not ours)."""
        return all(self._registry.alive(role) for role in INSTANCE_ROLES
                   if role != "store" or self.store_master.registers_stores)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Plan, reserve, prefill (its first tokens streamed as soon as the prompt is
        computed), then stream the decode instance's tokens."""
        flow = await self._plan(request)
        rid = request.request_id
        self._flows[rid] = flow
        prefilling: asyncio.Future[PrefillResult] | None = None
        try:
            await self._reserve_decode(flow)
            prefilling = asyncio.ensure_future(self._moves.prefill(flow, self._calls.prefill))
            computed = asyncio.ensure_future(flow.first_ready.wait())
            try:
                await asyncio.wait([prefilling, computed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                computed.cancel()
            # Streamed early only if some choice goes on: a request that ends at its first token
            # is answered once the result is in, so `_end` still cleans up its tail.
            firsts = None if flow.first is None else self._first_events(flow, flow.first)
            early = firsts is not None and any(e.finish_reason is None for e in firsts)
            if early:  # the client has these while the prompt's KV is still being written
                self.scheduler.first_token(rid)
                for event in firsts or ():
                    yield event
            result = await prefilling
            if result.held_s:  # its hand-off to the decode starts now (prefill/hand_on.py)
                self.scheduler.handed_on(rid)
            flow.got_first(result)  # the streamed ones win over a re-send's
            assert flow.first is not None
            flow.result = self._pinned(result, flow.first)
            if firsts is None:
                firsts = self._first_events(flow, flow.first)
            if not early:
                self.scheduler.first_token(rid)
                for event in firsts:
                    yield event
            choices = [flow] + [self._choice_flow(flow, i) for i in range(1, request.sampling.n)]
            streams = [self._decode_choice(one, rid) for one, first in zip(choices, firsts)
                       if first.finish_reason is None]
            if streams:
                # NOTE: aclosing, so closing this generator closes the decode streams now.
                async with aclosing(streams[0] if len(streams) == 1 else merged(streams)) as events:
                    async for event in events:
                        yield event
        finally:
            if prefilling is not None and not prefilling.done():
                prefilling.cancel()
            await self._end(flow)

    def _first_events(self, flow: RequestFlow, first: PrefillFirst) -> list[TokenEvent]:
        """Each choice's first token as the client sees it (usage and echo on the first)."""
        tokens = [FirstToken(token_id=first.first_token, logprob=first.first_logprob),
                  *first.other_choices]
        return [TokenEvent(t.token_id,
                           self._finish_at_first(flow.request.sampling.for_choice(i), t.token_id),
                           cached_tokens=first.cached_tokens if i == 0 else 0,
                           logprob=t.logprob, choice=i,
                           prompt_logprobs=first.prompt_logprobs if i == 0 else None)
                for i, t in enumerate(tokens)]

    @staticmethod
    def _pinned(result: PrefillResult, first: PrefillFirst) -> PrefillResult:
        """`result` with the first tokens the client already has (a re-sent prefill may have
        sampled others: its prompt KV is the same, its tokens are not what was streamed)."""
        return result.model_copy(update={"first_token": first.first_token,
                                         "first_logprob": first.first_logprob,
                                         "other_choices": first.other_choices})

    @staticmethod
    def _choice_flow(flow: RequestFlow, index: int) -> RequestFlow:
        """Choice `index` > 0 of a prefilled request: the same prompt KV, its own first token."""
        assert flow.result is not None
        first = flow.result.other_choices[index - 1]
        request = dataclasses.replace(flow.request, request_id=f"{flow.request_id}/{index}")
        result = flow.result.model_copy(update={"first_token": first.token_id,
                                                "first_logprob": first.logprob})
        return RequestFlow(request, flow.keys, flow.plan, result=result, choice=index)

    async def _decode_choice(self, flow: RequestFlow, rid: str) -> AsyncIterator[TokenEvent]:
        """One choice's tokens after its first (from the prefill): its decode stream; the
        scheduler counts them for request `rid`."""
        async with aclosing(self._moves.decode(flow, self._calls.decode)) as events:
            async for event in events:
                self.scheduler.token(rid)
                yield event

    async def _plan(self, request: GenerateRequest) -> RequestFlow:
        """Keys, then the scheduler's plan; 503 if a role has no live instance, 429 if the
        SLOs cannot be met (SLORejected, before any work)."""
        for role in ("store", "prefill", "decode"):  # NOTE: the order clients have seen
            if not self._registry.alive(role):
                raise BackendError(f"no {role} instance available", 503)
        keys = await block_keys_async(request.prompt_token_ids, self._config.block_tokens,
                                      self.namespace)
        plan = await self.scheduler.plan(request, keys)
        if plan is None:  # NOTE: the last prefill or decode instance left in between
            raise BackendError("no prefill or decode instance available", 503)
        if plan.cached_blocks:
            self._count_reuse(keys[:plan.cached_blocks])
        return RequestFlow(request, keys, plan)

    def _count_reuse(self, cached: list[str]) -> None:
        """Count hits on the cached prefix; hot blocks gain replicas in the background."""
        self.store_master.reuse(cached)

    async def _reserve_decode(self, flow: RequestFlow) -> None:
        """Decode admission before any prefill work: the planned decode instance (or the next
        one the scheduler offers) holds room for the request; SLORejected (429) if none will."""
        if flow.request.sampling.max_tokens <= 1:
            return  # the first token, from prefill, is the last one
        decode = await reserve_decode(self._http, self._headers, flow.request, flow.plan.decode,
                                      self.scheduler.repick_decode)
        flow.plan = flow.plan._replace(decode=decode)
        flow.reserved_on = decode

    @staticmethod
    def _finish_at_first(sampling: SamplingParams, first: int) -> str | None:
        """The finish reason if a choice's first token (from prefill) ends it."""
        if first in sampling.eos_token_ids and not sampling.ignore_eos:
            return "stop"
        if sampling.max_tokens == 1:
            return "length"
        return None

    async def _end(self, flow: RequestFlow) -> None:
        """Release what the request held, whatever the outcome."""
        rid = flow.request_id
        self._flows.pop(rid, None)
        self.scheduler.release(rid)
        if flow.reserved_on is not None:
            release_decode_later(self._http, self._headers, flow.reserved_on, rid,
                                 self._background)
        shared_tail = flow.request.sampling.n > 1  # the decode instances kept it (drop_tail)
        if flow.result is not None and (shared_tail or not flow.tail_settled):
            # NOTE: in the background: a request that ended at its first token was answered
            # after this store round trip (py-spy: half the conductor's time per such request).
            self._spawn(self._calls.remove_tail(flow))

    async def settled(self) -> None:
        """Wait for the work requests left behind (tail removals, releases, hot-block copies)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- operators (operator_routes.py) --------------------------------------------------------

    def running(self) -> list[RunningRequest]:
        """Requests in flight and the instance serving each."""
        return [RunningRequest(request_id=rid, phase=flow.phase,
                               instance_id=flow.serving().instance_id,
                               tokens=len(flow.delivered) + (flow.result is not None),
                               moves=flow.moves)
                for rid, flow in list(self._flows.items())]

    def migrate(self, request_id: str, target: str | None) -> MigrateReply:
        """Order a decoding request to move (to `target`, else the least loaded other decode
        instance); it leaves at its next token. LookupError / ValueError if it cannot."""
        flow = self._flows.get(request_id)
        if flow is None:
            raise LookupError(f"no request {request_id} in flight")
        if flow.phase != DECODE:
            raise ValueError(f"request {request_id} is not decoding yet")
        source = flow.plan.decode.instance_id
        if target is not None:
            live = {i.instance_id: i for i in self._registry.alive("decode")}
            if target == source:
                raise ValueError(f"request {request_id} already runs on {target}")
            if target not in live:
                raise ValueError(f"{target} is not a live decode instance")
            info = live[target]
        else:
            found = least_loaded(self._registry, "decode", {source})
            if found is None:
                raise ValueError("no other live decode instance to move to")
            info = found
        flow.move_target = info.instance_id
        flow.move.set()
        return MigrateReply(request_id=request_id, source=source, target=info.instance_id)


async def merged(streams: list[AsyncIterator[TokenEvent]]) -> AsyncIterator[TokenEvent]:
    """The events of every stream as they come; the first failure ends all (closing each)."""
    queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[TokenEvent]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for event in stream:
                    await queue.put(event)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
