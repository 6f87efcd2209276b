"""Real role apps served in-process for tests: uvicorn servers on one background event loop, so
tests drive them with blocking clients (hypothesis, schemathesis, httpx)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    """Uvicorn servers sharing one event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="test-servers")
        self._thread.start()
        self._servers: list[tuple[uvicorn.Server, Any]] = []

    def serve(self, app: Any, sock: socket.socket, timeout_s: float = 60.0) -> None:
        """Serve `app` on the bound `sock`; return once its lifespan has started."""
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                               timeout_graceful_shutdown=2))
        server.capture_signals = _no_signals  # type: ignore[method-assign]
        task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self._servers.append((server, task))
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if task.done():
                task.result()  # raises the start-up error
                raise RuntimeError("server exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in time")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the servers (last started first), then the loop."""
        for server, task in reversed(self._servers):
            server.should_exit = True
            # NOTE: shutting down; a failure here must not hide the test's own verdict.
            with contextlib.suppress(Exception):
                task.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _no_signals() -> Any:
    return contextlib.nullcontext()


def bound_socket() -> tuple[socket.socket, int]:
    """A listening-ready TCP socket on a free 127.0.0.1 port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]
