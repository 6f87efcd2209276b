"""A real cluster in one process for the scheduler's integration tests: conductor, store, two
prefill instances (one streaming KV layer by layer, one writing after the forward) and a decode
instance with a small KV pool, every role's real app over a tiny random Llama, KV over TCP.

The apps share one event loop in a background thread, so tests drive them with blocking clients.
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
from mooncake_server.roles import app_for_role

SECRET = "sched-cluster-secret"
BLOCK = 4  # tokens per KV block
CONTEXT = 128
DECODE_BLOCKS = 64  # the decode pool: two worst-case requests of the 128-token context


class _Servers:
    """Uvicorn servers sharing one event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[tuple[uvicorn.Server, Any]] = []

    def serve(self, app: Any, sock: socket.socket) -> None:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self._servers.append((server, task))
        deadline = time.monotonic() + 60
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in time")
            time.sleep(0.02)

    def stop(self) -> None:
        for server, task in reversed(self._servers):
            server.should_exit = True
            with contextlib.suppress(Exception):
                task.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Cluster:
    """Base URLs of each role; `prefill` lists prefill-0 (layer-wise) then prefill-1 (after)."""

    conductor: str = ""
    store: str = ""
    prefill: list[str] = field(default_factory=list)
    decode: str = ""
    headers: dict[str, str] = field(default_factory=lambda: {"X-Mooncake-Secret": SECRET})

    def metric(self, url: str, name: str) -> float:
        """Sum of one metric's samples on one role."""
        text = httpx.get(url + "/metrics", headers=self.headers, timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith(name + "_created"))


def _config(role: str, port: int, model: str, **extra: Any) -> ServerConfig:
    settings: dict[str, Any] = {
        "role": role, "port": port, "model": model, "served_model_name": "tiny",
        "cluster_secret": SECRET, "block_tokens": BLOCK, "kv_memory_bytes": 1 << 20,
        "store_memory_bytes": 16 << 20, "prefill_chunk_tokens": 8, "heartbeat_interval_s": 0.2,
        "transport": "tcp", "transfer_timeout_s": 5.0}
    return ServerConfig(**{**settings, **extra})


def start(model: str, policy: str) -> tuple[Cluster, _Servers, list[socket.socket]]:
    """Start every role; returns once the conductor sees all of them."""
    servers, sockets, c = _Servers(), [], Cluster()

    def serve(role: str, **extra: Any) -> str:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        port = sock.getsockname()[1]
        if role != "conductor":
            extra["conductor_url"] = c.conductor
        servers.serve(app_for_role(_config(role, port, model, **extra)), sock)
        return f"http://127.0.0.1:{port}"

    c.conductor = serve("conductor", policy=policy)
    c.store = serve("store")
    c.prefill = [serve("prefill", instance_id="prefill-0", kv_write="layer"),
                 serve("prefill", instance_id="prefill-1", kv_write="after")]
    block_bytes = 2 * 2 * BLOCK * 1 * 16 * 4  # layers x (K, V) x tokens x kv heads x dim x f32
    c.decode = serve("decode", instance_id="decode-0",
                     kv_memory_bytes=DECODE_BLOCKS * block_bytes)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.get(c.conductor + "/health", timeout=5)
        if r.status_code == 200 and r.json()["instances"]["prefill"] == 2:
            return c, servers, sockets
        time.sleep(0.05)
    raise RuntimeError("cluster did not become healthy")
