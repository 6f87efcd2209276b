"""Helpers of the fuzz tests: servers in a background thread, the tiny-model role configs.

A uniquely named module (not conftest) so tests import it without clashing with other folders'
conftest modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from mooncake_server.config import ServerConfig

API_KEY = "fuzz-api-key"
SECRET = "fuzz-cluster-secret"
CONTEXT = 128  # tokens: keeps the longest generation short
MAX_TOKENS = 16  # --max-tokens-limit of the servers under test


class ServerThread:
    """Uvicorn servers sharing one event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="fuzz-servers")
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


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    """Poll GET url/health until 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become healthy")


def role_config(role: str, port: int, model: str, **extra: Any) -> ServerConfig:
    return ServerConfig(role=role, port=port, model=model, served_model_name="tiny",
                        cluster_secret=SECRET, api_key=API_KEY, max_tokens_limit=MAX_TOKENS,
                        kv_memory_bytes=8 << 20, store_memory_bytes=64 << 20, max_batch_size=8,
                        prefill_chunk_tokens=64, heartbeat_interval_s=0.2, transport="tcp",
                        transfer_timeout_s=5.0, **extra)


@dataclass
class LiveCluster:
    """A conductor, a store, a prefill and a decode instance, each a real role app."""

    urls: dict[str, str]
    store_transfer_address: str = ""
    store_segment: str = ""
    store_control_address: str = ""
    sockets: list[socket.socket] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The public API (the conductor)."""
        return self.urls["conductor"]


def chat_ok(url: str, content: str = "Hello there", max_tokens: int = 4) -> dict[str, Any]:
    """One valid chat completion; asserts it succeeded."""
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": [{"role": "user", "content": content}],
                         "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["usage"]["completion_tokens"] >= 1
    return body
