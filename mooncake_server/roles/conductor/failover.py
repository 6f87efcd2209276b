"""Moving requests between instances: the conductor's side of decode migration and prefill resend.

A decoding request moves when its decode instance dies (broken stream), stalls (it misses
heartbeats while the stream is silent), reports an engine error, refuses the job, or when an
operator or policy orders it (POST /internal/migrate). The next instance gets a resume job: the
prompt, every output token the client already has, and the chained keys of every full block
of the computed tokens; it loads from the store what the previous instance wrote back and
recomputes the rest. Tokens carry their output index, so one the client already got is dropped.
A prefill job is re-sent to another prefill instance the same way (its result is not streamed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Depends, HTTPException
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.moves import MigrateReply, MigrateRequest, RunningRequest

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_WAIT_POLL_S = 0.2

# Why a request left an instance (label of the move counters).
DIED = "died"  # broken connection, or the stream ended without a final token
STALLED = "stalled"  # silent stream and missed heartbeats
ERROR = "error"  # the instance reported a failure for the request
REFUSED = "refused"  # the instance would not take the job (e.g. its KV cache is full)
ORDERED = "ordered"  # POST /internal/migrate (load shift)


class InstanceLost(Exception):
    """The instance serving a request is gone; `reason` is one of the constants above."""

    def __init__(self, message: str, reason: str, mark_down: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.mark_down = mark_down


class MoveOrdered(Exception):
    """An operator or policy asked for the request to move."""


class FailoverStats:
    """Counters of moves and re-sends, read by the conductor's /metrics."""

    def __init__(self) -> None:
        self.decode_moves: dict[str, int] = {}
        self.prefill_resends: dict[str, int] = {}
        self.duplicates_dropped = 0

    def moved(self, role: str, reason: str) -> None:
        """Count one move of a request off an instance of `role`."""
        table = self.decode_moves if role == "decode" else self.prefill_resends
        table[reason] = table.get(reason, 0) + 1


def check_interval(heartbeat_timeout_s: float) -> float:
    """How long a silent stream or call waits before the conductor checks the instance's
    heartbeats again."""
    return max(0.05, min(1.0, heartbeat_timeout_s / 2))


class LineFeed:
    """A peer's stream, opened, read and closed by one task of its own that queues its lines.

    The caller waits on the queue, so it can watch the instance's heartbeats and move orders
    while the stream is silent, and stop the reader (cancel) without being cancelled itself;
    the HTTP stream is never touched from two tasks.
    """

    def __init__(self, read: Callable[[Callable[[str], None]], Awaitable[None]]) -> None:
        """`read(emit)` opens the stream and calls `emit(line)` for each line."""
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run(read))

    async def _run(self, read: Callable[[Callable[[str], None]], Awaitable[None]]) -> None:
        try:
            await read(self._queue.put_nowait)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, raised there
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(_EOF)

    async def next(self, alive: Callable[[], bool], move: asyncio.Event,
                   check_s: float) -> str | None:
        """The next line (None at the end); raises what the reader raised, MoveOrdered when
        `move` is set, InstanceLost when the stream is silent and heartbeats stopped."""
        while True:
            if move.is_set():
                raise MoveOrdered()
            try:
                item = await asyncio.wait_for(self._queue.get(), check_s)
            except TimeoutError:
                if not alive():
                    raise InstanceLost("stream silent and heartbeats missed", STALLED,
                                       True) from None
                continue
            if item is _EOF:
                return None
            if isinstance(item, Exception):
                raise item
            return str(item)

    async def aclose(self) -> None:
        """Stop reading and wait until the stream is closed (the peer sees a disconnect)."""
        self._task.cancel()
        await asyncio.wait({self._task})


_EOF = object()


async def watch_call(call: Awaitable[_T], alive: Callable[[], bool], check_s: float) -> _T:
    """Await `call`; cancel it and raise InstanceLost if its instance misses heartbeats."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=check_s)
            if done:
                return task.result()
            if not alive():
                raise InstanceLost("no answer and heartbeats missed", STALLED, True)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def least_loaded(registry: InstanceRegistry, role: str,
                 exclude: set[str]) -> InstanceInfo | None:
    """The live instance of `role` (not in `exclude`) with the least reported work."""
    best: tuple[int, str] | None = None
    choice = None
    for info in registry.alive(role):
        if info.instance_id in exclude:
            continue
        beat = registry.load(info.instance_id)
        work = (beat.running + beat.waiting) if beat is not None else 0
        if best is None or (work, info.instance_id) < best:
            best, choice = (work, info.instance_id), info
    return choice


async def next_instance(registry: InstanceRegistry, role: str, exclude: set[str],
                        wait_s: float) -> InstanceInfo | None:
    """`least_loaded`, waiting up to `wait_s` for one to (re-)register; None if none did."""
    deadline = time.monotonic() + wait_s
    while True:
        info = least_loaded(registry, role, exclude)
        if info is not None or time.monotonic() >= deadline:
            return info
        await asyncio.sleep(_WAIT_POLL_S)


# ---- operators' endpoints -----------------------------------------------------------------------


class Migrating(Protocol):
    """The backend side the endpoints drive (DisaggregatedBackend)."""

    failover: FailoverStats

    def running(self) -> list[RunningRequest]:
        """Requests in flight."""
        ...

    def migrate(self, request_id: str, target: str | None) -> MigrateReply:
        """Order a move; LookupError if unknown, ValueError if it cannot move now."""
        ...


def find_migrating(backend: Any) -> Migrating | None:
    """The backend that can migrate, found through wrappers (`.inner`), or None."""
    while backend is not None and not hasattr(backend, "migrate"):
        backend = getattr(backend, "inner", None)
    return backend


def failover_router(backend: Callable[[], Migrating | None], secret: str) -> APIRouter:
    """Routes: POST /internal/migrate, GET /internal/requests (cluster secret required)."""
    router = APIRouter(prefix="/internal", dependencies=[Depends(require_secret(secret))])

    def current() -> Migrating:
        found = backend()
        if found is None:
            raise HTTPException(503, "the conductor is not serving yet")
        return found

    @router.post("/migrate")
    async def migrate(body: MigrateRequest) -> MigrateReply:
        """Move a decoding request to another decode instance (load shift)."""
        try:
            return current().migrate(body.request_id, body.target)
        except LookupError as exc:
            raise HTTPException(404, str(exc)) from None
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from None

    @router.get("/requests")
    async def requests() -> list[RunningRequest]:
        """Requests in flight and the instance serving each."""
        return current().running()

    return router


class FailoverCollector(Collector):
    """Exports the move counters and the number of requests in flight."""

    def __init__(self, backend: Callable[[], Migrating | None]) -> None:
        self._backend = backend

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Samples at scrape time (zeros before the backend exists)."""
        found = self._backend()
        stats = found.failover if found is not None else FailoverStats()
        moves = CounterMetricFamily("mooncake_conductor_decode_moves",
                                    "Decoding requests moved to another decode instance",
                                    labels=["reason"])
        for reason, n in sorted(stats.decode_moves.items()):
            moves.add_metric([reason], n)
        yield moves
        resends = CounterMetricFamily("mooncake_conductor_prefill_resends",
                                      "Prefill jobs re-sent to another prefill instance",
                                      labels=["reason"])
        for reason, n in sorted(stats.prefill_resends.items()):
            resends.add_metric([reason], n)
        yield resends
        yield CounterMetricFamily("mooncake_conductor_duplicate_tokens_dropped",
                                  "Tokens a moved request produced again, not passed on",
                                  value=stats.duplicates_dropped)
        yield GaugeMetricFamily("mooncake_conductor_requests_running", "Requests in flight",
                                value=len(found.running()) if found is not None else 0)
