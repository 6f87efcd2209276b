"""Helpers of the security tests: a scripted backend and an app served live in the test's loop.

A uniquely named module (not conftest) so tests import it without clashing with other folders'
conftest modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from mooncake_server.api.backend import GenerateRequest, TokenEvent

MODEL = "test-model"
MAX_MODEL_LEN = 256


@dataclass
class EchoBackend:
    """Yields two fixed tokens; records the requests it was given."""

    requests: list[GenerateRequest] = field(default_factory=list)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Two tokens, the last one finishing the request."""
        self.requests.append(request)
        yield TokenEvent(28, None, 0)
        yield TokenEvent(29, "stop", 0)

    def ready(self) -> bool:
        """Always ready."""
        return True


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # NOTE: leave pytest's signal handlers alone


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run `app` on a free 127.0.0.1 port in this event loop; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _QuietServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 10
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
