"""Moves: a request's prefill and decode phases, each carried on to another instance on a fault.

A prefill job walks: sent -> its instance dies (connection broken), stalls (no answer while it
misses heartbeats) or fails it -> re-sent to the least loaded other prefill instance (after a
death, waiting up to --failover-wait for one) -> ... at most _MAX_PREFILL_FAILURES times.
A decoding request walks: streaming from one decode instance -> that instance dies, stalls,
fails or refuses it, or an operator orders a move (POST /internal/migrate) -> a resume job
(prompt + every output token the client has, chained keys of every computed full block) on
the next decode instance, which loads what the store holds and recomputes the rest -> ...
Tokens carry their output index; one the client already has is dropped (instance_calls.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from functools import partial

from mooncake_server.api.backend import BackendError, TokenEvent
from mooncake_server.block_keys import block_keys_async
from mooncake_server.config import ServerConfig
from mooncake_server.roles.conductor.flow import DECODE, RequestFlow
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.watch import (
    DIED,
    ERROR,
    ORDERED,
    REFUSED,
    STALLED,
    InstanceLost,
    MoveOrdered,
    check_interval,
    next_instance,
    watch_call,
)
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.jobs import DecodeJob, PrefillResult

log = logging.getLogger(__name__)

# Moves of one request after failures (moves an operator orders are not counted).
_MAX_DECODE_FAILURES = 4
_MAX_PREFILL_FAILURES = 3

SendPrefill = Callable[[RequestFlow, InstanceInfo], Awaitable[PrefillResult]]
StreamDecode = Callable[[RequestFlow, InstanceInfo, DecodeJob], AsyncGenerator[TokenEvent, None]]
# (request id, new decode instance id): the scheduler's ledger follows the request.
FollowDecode = Callable[[str, str], None]


class MoveStats:
    """Counters of moves and re-sends, read by the conductor's /metrics."""

    def __init__(self) -> None:
        self.decode_moves: dict[str, int] = {}
        self.prefill_resends: dict[str, int] = {}
        self.duplicates_dropped = 0

    def moved(self, role: str, reason: str) -> None:
        """Count one move of a request off an instance of `role`."""
        table = self.decode_moves if role == "decode" else self.prefill_resends
        table[reason] = table.get(reason, 0) + 1


class RequestMoves:
    """Runs a request's prefill and its decode stream, moving either to another instance when
    the one serving it dies, stalls, fails or refuses it, or an operator orders a move."""

    def __init__(self, config: ServerConfig, registry: InstanceRegistry, namespace: str,
                 stats: MoveStats, follow_decode: FollowDecode) -> None:
        self._config = config
        self._registry = registry
        self._namespace = namespace
        self._stats = stats
        self._follow_decode = follow_decode
        self._check_s = check_interval(config.heartbeat_timeout_s)

    async def prefill(self, flow: RequestFlow, send: SendPrefill) -> PrefillResult:
        """`send` the prefill job, re-sent to another prefill instance when the one running it
        dies, stalls or fails it."""
        failures = 0
        shunned: set[str] = set()
        while True:
            prefill = flow.plan.prefill
            try:
                return await watch_call(send(flow, prefill),
                                        partial(self._registry.is_alive, prefill.instance_id),
                                        self._check_s)
            except InstanceLost as exc:
                self._registry.mark_down(prefill.instance_id)
                reason, error = exc.reason, BackendError(str(exc), 503)
            except BackendError as exc:
                if exc.status not in (502, 503):
                    raise  # a problem with the request itself: another instance won't help
                # `send` marks an unreachable instance down; one that answered with an
                # error is only avoided for this request.
                died = not self._registry.is_alive(prefill.instance_id)
                reason, error = (DIED if died else ERROR), exc
                if not died:
                    shunned.add(prefill.instance_id)
            failures += 1
            log.warning("request %s: prefill on %s failed (%s): %s", flow.request_id,
                        prefill.instance_id, reason, error)
            if failures > _MAX_PREFILL_FAILURES:
                raise error
            wait = self._config.failover_wait_s if reason in (DIED, STALLED) else 0.0
            info = await next_instance(self._registry, "prefill", shunned, wait)
            if info is None:
                raise error
            self._stats.moved("prefill", reason)
            flow.moves += 1
            flow.plan = flow.plan._replace(prefill=info)

    async def decode(self, flow: RequestFlow,
                     stream: StreamDecode) -> AsyncGenerator[TokenEvent, None]:
        """The decode tokens from `stream`; the request moves to another decode instance when
        its instance dies, stalls, fails or refuses it, or an operator orders it."""
        flow.phase = DECODE
        failures = 0
        while True:
            decode = flow.plan.decode
            try:
                job = await self._decode_job(flow)
                # NOTE: aclosing: the client leaving must close this stream now, not at GC.
                async with aclosing(stream(flow, decode, job)) as events:
                    async for event in events:
                        yield event
                return
            except MoveOrdered:
                reason, why = ORDERED, "moved on request"
            except InstanceLost as exc:
                reason, why = exc.reason, str(exc)
                failures += 1
                if exc.mark_down:
                    self._registry.mark_down(decode.instance_id)
                if reason in (REFUSED, ERROR):
                    flow.refused.add(decode.instance_id)
                log.warning("request %s lost decode instance %s (%s: %s)",
                            flow.request_id, decode.instance_id, reason, exc)
                if failures > _MAX_DECODE_FAILURES:
                    raise BackendError(f"decoding failed on {failures} instances; last: {exc}",
                                       503) from exc
            await self._move_decode(flow, reason, why)

    async def _decode_job(self, flow: RequestFlow) -> DecodeJob:
        """The decode job; once output went out, a resume job from the client's last token."""
        result = flow.result
        if result is None:
            raise RuntimeError("decode before prefill")  # NOTE: a bug in the request path
        job = DecodeJob(request_id=flow.request_id,
                        prompt_token_ids=flow.request.prompt_token_ids,
                        first_token=result.first_token, block_keys=flow.keys,
                        tail_key=result.tail_key, block_checksums=result.block_checksums,
                        sampling=flow.sampling, kv_namespace=self._namespace,
                        drop_tail=flow.request.sampling.n == 1)
        if not flow.delivered:
            return job
        prompt = flow.request.prompt_token_ids
        # Every full block of the tokens whose KV the last instance computed (all but the
        # newest token): it wrote them back as they filled. The chain only grows, so each
        # token is hashed once however often the request moves.
        computed = [*prompt, result.first_token, *flow.delivered[:-1]]
        bt = self._config.block_tokens
        done = len(flow.chain) * bt
        flow.chain += await block_keys_async(computed[done:], bt, self._namespace,
                                             after=flow.chain[-1] if flow.chain else None)
        return job.model_copy(update={
            "block_keys": list(flow.chain), "tail_key": None,
            "block_checksums": result.block_checksums[:len(prompt) // bt],
            "generated_token_ids": list(flow.delivered)})

    async def _move_decode(self, flow: RequestFlow, reason: str, why: str) -> None:
        """Point the flow at the next decode instance: the ordered target, else the least
        loaded live one (after a death, waiting up to --failover-wait for one to register)."""
        source = flow.plan.decode.instance_id
        target, flow.move_target = flow.move_target, None
        flow.move.clear()
        info = None
        if reason == ORDERED and target is not None and self._registry.is_alive(target):
            info = self._registry.get(target)
        if info is None:
            exclude = flow.refused | ({source} if reason == ORDERED else set())
            wait = self._config.failover_wait_s if reason in (DIED, STALLED) else 0.0
            info = await next_instance(self._registry, "decode", exclude, wait)
        if info is None:
            raise BackendError(f"{why}; no other live decode instance can take it", 503)
        self._stats.moved("decode", reason)
        flow.moves += 1
        self._follow_decode(flow.request_id, info.instance_id)
        log.info("request %s moves from decode instance %s to %s (%s) after %d tokens",
                 flow.request_id, source, info.instance_id, reason, 1 + len(flow.delivered))
        flow.plan = flow.plan._replace(decode=info)
