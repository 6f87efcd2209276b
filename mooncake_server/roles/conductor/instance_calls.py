"""The conductor's calls to one instance for one request: a prefill job, a decode stream, and
removing a tail block from the store. Failures become `BackendError` (the client's status) or
`InstanceLost` (the request moves on, moves.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial

import httpx

from mooncake_server.api.backend import BackendError, TokenEvent
from mooncake_server.roles.conductor.flow import RequestFlow
from mooncake_server.roles.conductor.master_link import MasterLink, MasterUnavailable
from mooncake_server.roles.conductor.moves import MoveStats
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.watch import (
    DIED,
    ERROR,
    REFUSED,
    InstanceLost,
    LineFeed,
    check_interval,
)
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.jobs import DecodeEvent, DecodeJob, ErrorEvent, PrefillJob, PrefillResult
from mooncake_server.wire.routes import (
    DECODE,
    PREFILL,
    STORE_REMOVE,
    CallError,
    InvalidReply,
    PeerRefused,
    PeerUnreachable,
    open_stream,
    send,
)
from mooncake_server.wire.store_ops import StoreKeys

log = logging.getLogger(__name__)


def peer_status(status: int | None) -> int:
    """HTTP status the client sees for a peer's failure status."""
    if status is not None and (status in (429, 503) or (
            400 <= status < 500 and status not in (401, 403, 404, 405))):
        return status  # overload or a problem with the request itself: pass it on
    return 502  # a peer misbehaving or misconfigured is a bad gateway from the client's view


class InstanceCalls:
    """One request's calls to the prefill / decode / store instance it is placed on."""

    def __init__(self, http: httpx.AsyncClient, headers: dict[str, str],
                 timeout: httpx.Timeout, registry: InstanceRegistry, store_master: MasterLink,
                 stats: MoveStats, heartbeat_timeout_s: float) -> None:
        self._http = http
        self._headers = headers
        self._timeout = timeout
        self._registry = registry
        self._store_master = store_master
        self._stats = stats
        self._check_s = check_interval(heartbeat_timeout_s)

    async def prefill(self, flow: RequestFlow, prefill: InstanceInfo) -> PrefillResult:
        """Run the request's prefill job on `prefill`; its KV lands in the store. Its first
        tokens go to `flow.got_first` as soon as the instance sends them, before the result."""
        plan = flow.plan
        # A re-sent job (its first instance failed) is not held to the admission's deadline,
        # nor to its burst's ranks on the first instance.
        order = None if flow.moves else plan.order
        now = time.monotonic()
        within = (None if plan.start_by is None or flow.moves
                  else max(0.0, plan.start_by - now))
        due = None if plan.answer_by is None or flow.moves else max(0.0, plan.answer_by - now)
        expect = plan.expect_by
        expect = None if expect is None or flow.moves else max(0.0, expect - now)
        job = PrefillJob(request_id=flow.request_id,
                         prompt_token_ids=flow.request.prompt_token_ids, block_keys=flow.keys,
                         sampling=flow.request.sampling, reuse=plan.reuse,
                         burst_at=order.burst_at if order else None,
                         burst_rank=order.rank if order else 0,
                         burst_pass=order.pass_ranks if order else 0, start_within_s=within,
                         answer_within_s=due, expect_within_s=expect,
                         pass_tail=plan.prefill_estimate.pass_tail and not flow.moves)
        where = f"prefill instance {prefill.instance_id}"
        try:
            async with open_stream(self._http, prefill.url, PREFILL, job, headers=self._headers,
                                   timeout=self._timeout) as lines:
                async for raw in lines:
                    if not raw.strip():
                        continue
                    line = PREFILL.parse(raw, where)
                    if isinstance(line, ErrorEvent):
                        raise BackendError(f"{where} failed: {line.error}", 503)
                    if isinstance(line, PrefillResult):
                        return line
                    flow.got_first(line)
        except PeerUnreachable as exc:
            self._registry.mark_down(prefill.instance_id)
            raise BackendError(f"{where} unreachable: {exc.__cause__!r}", 503) from exc
        except InvalidReply as exc:
            raise BackendError(f"{where} sent an invalid result", 502) from exc
        except CallError as exc:
            raise BackendError(f"{where} failed: {exc.detail or exc}",
                               peer_status(exc.status)) from exc
        raise BackendError(f"{where} ended its answer without a result", 503)

    async def decode(self, flow: RequestFlow, decode: InstanceInfo,
                     job: DecodeJob) -> AsyncGenerator[TokenEvent, None]:
        """`decode`'s token stream for `job`; InstanceLost / MoveOrdered end it early."""
        where = f"decode instance {decode.instance_id}"
        alive = partial(self._registry.is_alive, decode.instance_id)
        feed = LineFeed(partial(self._read_decode, flow, decode, job))
        try:
            while (line := await feed.next(alive, flow.move, self._check_s)) is not None:
                event = self._next_event(flow, line, where)
                if event is None:
                    continue
                flow.delivered.append(event.token_id)
                yield TokenEvent(event.token_id, event.finish_reason, logprob=event.logprob,
                                 choice=flow.choice)
                if event.finish_reason is not None:
                    return
        finally:
            await feed.aclose()
        raise InstanceLost(f"{where} ended the stream without a final token", DIED, False)

    async def _read_decode(self, flow: RequestFlow, decode: InstanceInfo, job: DecodeJob,
                           emit: Callable[[str], None]) -> None:
        """Send the job and emit the stream's lines (runs in the LineFeed's own task)."""
        where = f"decode instance {decode.instance_id}"
        try:
            async with open_stream(self._http, decode.url, DECODE, job, headers=self._headers,
                                   timeout=self._timeout) as lines:
                flow.tail_settled = True  # decode accepted the job: its tail is decode's now
                flow.reserved_on = None  # and the job claimed the reservation
                async for line in lines:
                    emit(line)
        except PeerUnreachable as exc:
            raise InstanceLost(f"{where} failed mid-stream: {exc.__cause__!r}", DIED,
                               True) from exc
        except PeerRefused as exc:
            if exc.status == 503:
                raise InstanceLost(f"{where} refused: {exc.detail}", REFUSED, False) from exc
            raise BackendError(f"{where} failed: {exc.detail}",
                               peer_status(exc.status)) from exc
        except CallError as exc:
            raise BackendError(f"{where} failed: {exc}", 502) from exc

    def _next_event(self, flow: RequestFlow, line: str, where: str) -> DecodeEvent | None:
        """The stream line's token, None for a blank line or a token the client already has;
        an error line raises InstanceLost (the request moves on)."""
        if not line.strip():
            return None
        try:
            event = DECODE.parse(line)
        except InvalidReply as exc:
            raise BackendError(f"{where} sent an invalid stream line", 502) from exc
        if isinstance(event, ErrorEvent):  # the instance failed the request: it moves on
            raise InstanceLost(f"{where}: {event.error}", ERROR, False)
        expected = 1 + len(flow.delivered)
        if event.index is not None and event.index < expected:
            self._stats.duplicates_dropped += 1  # a moved request repeating itself
            return None
        if event.index is not None and event.index > expected:
            raise BackendError(f"{where} skipped output tokens {expected}..{event.index - 1}",
                               502)
        return event

    async def remove_tail(self, flow: RequestFlow) -> None:
        """Drop the request's partial tail block from every node that holds it: no decode
        instance will read it."""
        tail = flow.result.tail_key if flow.result else None
        if tail is None:
            return
        flow.tail_settled = True  # NOTE: try once, whatever the outcome
        try:
            where = await self._store_master.locate([tail])
        except MasterUnavailable as exc:
            log.warning("removing tail %s: %s", tail, exc)
            return
        for replica in where.replicas[0]:
            store = where.nodes[replica.node_id]
            try:
                await send(self._http, store.url, STORE_REMOVE, StoreKeys(keys=[tail]),
                           headers=self._headers, timeout=5.0)
            except CallError as exc:
                log.warning("removing tail %s from store %s failed: %s", tail,
                            store.instance_id, exc)
