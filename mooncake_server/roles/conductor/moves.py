"""The moving half of the conductor's request path (mixed into DisaggregatedBackend).

A prefill job walks: sent -> its instance dies (connection broken), stalls (no answer while it
misses heartbeats) or fails it -> re-sent to the least loaded other prefill instance (after a
death, waiting up to --failover-wait for one) -> ... at most _MAX_PREFILL_FAILURES times.
A decoding request walks: streaming from one decode instance -> that instance dies, stalls,
fails or refuses it, or an operator orders a move (POST /internal/migrate) -> a resume job
(prompt + every output token the client has, chained keys of every computed full block) on
the next decode instance, which loads what the store holds and recomputes the rest -> ...
Tokens carry their output index; one the client already has is dropped (failover.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from functools import partial
from typing import Any, Protocol

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.block_keys import block_keys
from mooncake_server.config import ServerConfig
from mooncake_server.roles.conductor.failover import (
    DIED,
    ERROR,
    ORDERED,
    REFUSED,
    STALLED,
    FailoverStats,
    InstanceLost,
    MoveOrdered,
    least_loaded,
    next_instance,
    watch_call,
)
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.wire.instances import InstanceInfo, StoreLocation
from mooncake_server.wire.jobs import DecodeJob, PrefillResult
from mooncake_server.wire.moves import MigrateReply, RunningRequest

log = logging.getLogger(__name__)

# Hashing this many tokens takes ~10 ms: above it, do it off the event loop.
_KEYS_IN_THREAD_ABOVE = 100_000
# Moves of one request after failures (moves an operator orders are not counted).
_MAX_DECODE_FAILURES = 4
_MAX_PREFILL_FAILURES = 3


class MovableFlow(Protocol):
    """What the moves read and change of a request's state (disagg_backend._Flow)."""

    request: GenerateRequest
    keys: list[str]
    placement: Any  # Placement: (store, prefill, decode)
    store: StoreLocation
    result: PrefillResult | None
    phase: str
    delivered: list[int]
    moves: int
    move: asyncio.Event
    move_target: str | None
    refused: set[str]


class RequestMoves:
    """Re-sends prefill jobs and moves decoding requests; DisaggregatedBackend provides the
    single-instance calls (`_prefill`, `_decode_on`) and the state below."""

    _config: ServerConfig
    _registry: InstanceRegistry
    _picker: Any  # the InstancePicker (the scheduler keeps a ledger there)
    _flows: dict[str, Any]
    _check_s: float
    failover: FailoverStats
    namespace: str
    _prefill: Callable[[Any], Any]
    _decode_on: Callable[[Any, InstanceInfo, DecodeJob], AsyncGenerator[TokenEvent, None]]

    async def _decode(self, flow: MovableFlow) -> AsyncGenerator[TokenEvent, None]:
        """Stream the decode tokens; move the request to another decode instance when its
        instance dies, stalls, fails or refuses it, or an operator orders it."""
        flow.phase = "decode"
        failures = 0
        while True:
            decode = flow.placement.decode
            try:
                job = await self._decode_job(flow)
                # NOTE: aclosing: the client leaving must close this stream now, not at GC.
                async with aclosing(self._decode_on(flow, decode, job)) as events:
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
                            flow.request.request_id, decode.instance_id, reason, exc)
                if failures > _MAX_DECODE_FAILURES:
                    raise BackendError(f"decoding failed on {failures} instances; last: {exc}",
                                       503) from exc
            await self._move_decode(flow, reason, why)

    async def _decode_job(self, flow: MovableFlow) -> DecodeJob:
        """The decode job; once output went out, a resume job from the client's last token."""
        result = flow.result
        if result is None:
            raise RuntimeError("decode before prefill")  # NOTE: a bug in this module
        job = DecodeJob(request_id=flow.request.request_id,
                        prompt_token_ids=flow.request.prompt_token_ids,
                        first_token=result.first_token, block_keys=flow.keys,
                        tail_key=result.tail_key, block_checksums=result.block_checksums,
                        sampling=flow.request.sampling, store=flow.store,
                        kv_namespace=self.namespace)
        if not flow.delivered:
            return job
        prompt = flow.request.prompt_token_ids
        # Every full block of the tokens whose KV the last instance computed (all but the
        # newest token): it wrote them back as they filled.
        computed = [*prompt, result.first_token, *flow.delivered[:-1]]
        bt = self._config.block_tokens
        if len(computed) > _KEYS_IN_THREAD_ABOVE:
            keys = await asyncio.to_thread(block_keys, computed, bt, self.namespace)
        else:
            keys = block_keys(computed, bt, self.namespace)
        return job.model_copy(update={
            "block_keys": keys, "tail_key": None,
            "block_checksums": result.block_checksums[:len(prompt) // bt],
            "generated_token_ids": list(flow.delivered)})

    async def _move_decode(self, flow: MovableFlow, reason: str, why: str) -> None:
        """Point the flow at the next decode instance: the ordered target, else the least
        loaded live one (after a death, waiting up to --failover-wait for one to register)."""
        source = flow.placement.decode.instance_id
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
        self.failover.moved("decode", reason)
        flow.moves += 1
        # The scheduler's ledger follows the request (its load and token gaps count there now).
        moved = getattr(getattr(self._picker, "tracker", None), "move_decode", None)
        if moved is not None:
            moved(flow.request.request_id, info.instance_id)
        log.info("request %s moves from decode instance %s to %s (%s) after %d tokens",
                 flow.request.request_id, source, info.instance_id, reason,
                 1 + len(flow.delivered))
        flow.placement = flow.placement._replace(decode=info)

    async def _prefill_resending(self, flow: MovableFlow) -> PrefillResult:
        """`_prefill`, re-sent to another prefill instance when the one running it dies,
        stalls or fails it."""
        failures = 0
        shunned: set[str] = set()
        while True:
            prefill = flow.placement.prefill
            try:
                return await watch_call(self._prefill(flow),
                                        partial(self._registry.is_alive, prefill.instance_id),
                                        self._check_s)
            except InstanceLost as exc:
                self._registry.mark_down(prefill.instance_id)
                reason, error = exc.reason, BackendError(str(exc), 503)
            except BackendError as exc:
                if exc.status not in (502, 503):
                    raise  # a problem with the request itself: another instance won't help
                # _prefill marks an unreachable instance down; one that answered with an
                # error is only avoided for this request.
                died = not self._registry.is_alive(prefill.instance_id)
                reason, error = (DIED if died else ERROR), exc
                if not died:
                    shunned.add(prefill.instance_id)
            failures += 1
            log.warning("request %s: prefill on %s failed (%s): %s", flow.request.request_id,
                        prefill.instance_id, reason, error)
            if failures > _MAX_PREFILL_FAILURES:
                raise error
            wait = self._config.failover_wait_s if reason in (DIED, STALLED) else 0.0
            info = await next_instance(self._registry, "prefill", shunned, wait)
            if info is None:
                raise error
            self.failover.moved("prefill", reason)
            flow.moves += 1
            flow.placement = flow.placement._replace(prefill=info)

    def running(self) -> list[RunningRequest]:
        """Requests in flight and the instance serving each."""
        out = []
        for rid, flow in list(self._flows.items()):
            on = flow.placement.decode if flow.phase == "decode" else flow.placement.prefill
            out.append(RunningRequest(
                request_id=rid, phase=flow.phase, instance_id=on.instance_id,
                tokens=len(flow.delivered) + (flow.result is not None), moves=flow.moves))
        return out

    def migrate(self, request_id: str, target: str | None) -> MigrateReply:
        """Order a decoding request to move (to `target`, else the least loaded other decode
        instance); it leaves at its next token. LookupError / ValueError if it cannot."""
        flow = self._flows.get(request_id)
        if flow is None:
            raise LookupError(f"no request {request_id} in flight")
        if flow.phase != "decode":
            raise ValueError(f"request {request_id} is not decoding yet")
        source = flow.placement.decode.instance_id
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
