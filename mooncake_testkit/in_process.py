"""Apps served in this process by uvicorn: on the caller's event loop (`serve_app`, for async
tests), or on a background loop thread that blocking clients drive (`ServerThread`: hypothesis,
schemathesis, httpx), and a cluster of real role apps on one such thread (`AppCluster`).

Every server here runs its app's lifespan strictly (a failing start-up fails the caller) and
leaves the caller's signal handlers alone. OS processes, killable one by one: `role_procs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn

from mooncake_server.instance.http_server import server_config
from mooncake_testkit.ports import bound_socket

if TYPE_CHECKING:
    from typing_extensions import Self

    from mooncake_server.config import ServerConfig

START_TIMEOUT_S = 60.0


def wait_healthy(url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll GET url/health until it answers 200; raises once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become healthy")


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # NOTE: leave pytest's (or the script's) signal handlers alone


def _server(app: Any) -> _QuietServer:
    return _QuietServer(server_config(app, log_level="warning", lifespan="on",
                                      timeout_graceful_shutdown=2))


def _url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _started(server: uvicorn.Server, task: Any, deadline: float) -> bool:
    """True once `server` serves; raises if its task (`serve()`) ended or the deadline passed."""
    if server.started:
        return True
    if task.done():
        task.result()  # raises the start-up error
        raise RuntimeError("server exited during start-up")
    if time.monotonic() > deadline:
        raise RuntimeError("server did not start in time")
    return False


@contextlib.asynccontextmanager
async def serve_app(app: Any, timeout_s: float = START_TIMEOUT_S) -> AsyncIterator[str]:
    """Run `app` (lifespan included) on a free 127.0.0.1 port in this event loop; yield its URL."""
    sock, _ = bound_socket()
    server = _server(app)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + timeout_s
        while not _started(server, task, deadline):
            await asyncio.sleep(0.01)
        yield _url(sock)
    finally:
        server.should_exit = True
        await asyncio.wait({task})
        sock.close()


class ServerThread:
    """Uvicorn servers sharing one event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="test-servers")
        self._thread.start()
        self._servers: list[tuple[uvicorn.Server, Any, socket.socket]] = []

    def serve(self, app: Any, sock: socket.socket, timeout_s: float = START_TIMEOUT_S) -> str:
        """Serve `app` on the bound `sock` (closed by `stop`); its URL once its lifespan started."""
        server = _server(app)
        task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self._servers.append((server, task, sock))
        deadline = time.monotonic() + timeout_s
        while not _started(server, task, deadline):
            time.sleep(0.02)
        return _url(sock)

    def stop(self) -> None:
        """Stop the servers (last started first), then the loop; close their sockets."""
        for server, task, _ in reversed(self._servers):
            server.should_exit = True
            # NOTE: shutting down; a failure here must not hide the test's own verdict.
            with contextlib.suppress(Exception):
                task.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        for _, _, sock in self._servers:
            sock.close()


class AppCluster:
    """Roles' real apps, built by `app_for_role` exactly as the CLI builds them, served on one
    `ServerThread`: a whole cluster in this process, so tests see every role's logs and state."""

    def __init__(self) -> None:
        self.servers = ServerThread()
        self.urls: dict[str, str] = {}
        self.apps: dict[str, Any] = {}

    def add(self, name: str, config_at: Callable[[int], ServerConfig]) -> str:
        """Serve the role `config_at(port)` describes on a free port, as `name`; its URL."""
        from mooncake_server.roles import app_for_role

        sock, port = bound_socket()
        try:
            app = app_for_role(config_at(port))
        except BaseException:
            sock.close()
            raise
        self.apps[name] = app
        self.urls[name] = self.servers.serve(app, sock)
        return self.urls[name]

    def stop(self) -> None:
        """Stop every app (last added first)."""
        self.servers.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
