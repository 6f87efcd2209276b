"""Watching the instance that serves a request: is it still alive, and was a move ordered?

A call or stream to an instance ends in one of the ways named below (the label of the move
counters); `InstanceLost` carries it to `moves.py`, which sends the request elsewhere. Both
watchers poll the instance's heartbeats while the peer is silent, so a hung instance is left
as soon as the registry stops seeing it, not when a long timeout runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.wire.instances import InstanceInfo

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
