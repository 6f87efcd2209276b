"""Graceful SIGTERM for a single-role process: drain first, then let uvicorn shut down.

SIGTERM walks: the role's drain hook (`app.state.drain`: tell the conductor to route nothing new
here, then wait until the running work is done, at most --drain-timeout) -> uvicorn's usual
shutdown (listener closed, open connections finished, lifespan shutdown, which deregisters).
A second SIGTERM, or a SIGINT, skips what is left of the drain. A role without a hook (the
conductor) shuts down as uvicorn always does. Once started, the start-up heap is frozen (heap.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from mooncake_server.instance.heap import freeze_startup_heap

log = logging.getLogger(__name__)

DrainHook = Callable[[], Awaitable[None]]
_POLL_S = 0.1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM runs the app's drain hook before shutting down."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up (the role's lifespan included), then the start-up heap freezes."""
        await super().startup(sockets)
        freeze_startup_heap()

    def _hook(self) -> DrainHook | None:
        return getattr(self._app.state, "drain", None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First SIGTERM: drain (started from the next tick, on the event loop); else as usual."""
        if (sig == signal.SIGTERM and not self._drain_requested and not self.should_exit
                and self._hook() is not None):
            # NOTE: a signal handler must not touch the event loop; on_tick picks this up.
            self._drain_requested = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), which also starts the drain and ends the serving."""
        hook = self._hook()
        if self._drain_requested and self._drain_task is None and hook is not None:
            log.info("SIGTERM: draining before shutdown")
            self._drain_task = asyncio.create_task(self._drain(hook), name="drain")
        if self._drain_task is not None and self._drain_task.done():
            self.should_exit = True
        return await super().on_tick(counter)

    @staticmethod
    async def _drain(hook: DrainHook) -> None:
        try:
            await hook()
        except Exception:  # a failed drain must still let the process stop
            log.exception("drain failed; shutting down now")


async def wait_until_idle(busy: Callable[[], bool], timeout_s: float, what: str) -> bool:
    """Poll `busy()` until it is False or `timeout_s` passed; True if it went idle."""
    deadline = time.monotonic() + timeout_s
    while busy():
        if time.monotonic() >= deadline:
            log.warning("drain: %s still busy after %.0f s; shutting down anyway", what,
                        timeout_s)
            return False
        await asyncio.sleep(_POLL_S)
    return True
