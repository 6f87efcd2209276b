"""Store test rigs: the real store-index routes served in-process, store nodes as OS processes."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from mooncake_server.roles.conductor.registry import InstanceRegistry, registry_router
from mooncake_server.roles.conductor.store_index.master import (
    StoreMaster,
    master_router,
    serve_index_channel,
)
from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_server.wire.rpc import RpcServer
from mooncake_testkit.launcher import free_port_block

SECRET = "store-procs-secret"
HEADERS = {SECRET_HEADER: SECRET}


def addr_of(buf: memoryview | bytearray) -> int:
    """Address of a writable buffer (for transfer requests)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


async def until(predicate: Callable[[], object], timeout_s: float = 15.0,
                what: str = "condition") -> None:
    """Poll `predicate` (sync, or returning an awaitable) until truthy, or fail at a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s}s")
        await asyncio.sleep(0.02)


@dataclass
class IndexServer:
    """The conductor's registry + store-master routes on a local port (no model needed), and
    the index's binary report channel."""

    url: str
    master: StoreMaster
    registry: InstanceRegistry
    channel: RpcServer


@contextlib.asynccontextmanager
async def index_server(replicas: int, **master_kw: object) -> AsyncIterator[IndexServer]:
    """Serve the real registry and store-index routers and channel, as the conductor does."""
    registry = InstanceRegistry(heartbeat_timeout_s=1.0)
    master = StoreMaster(registry, replicas, SECRET, **master_kw)  # type: ignore[arg-type]
    app = FastAPI()
    app.include_router(registry_router(registry, SECRET))
    app.include_router(master_router(master, SECRET))
    channel = await serve_index_channel(master, "127.0.0.1", 0, "127.0.0.1", SECRET)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started, what="index server start")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield IndexServer(f"http://127.0.0.1:{port}", master, registry, channel)
    finally:
        server.should_exit = True
        await task
        await channel.close()


@dataclass
class StoreProc:
    """One `python -m mooncake_server --role store` process."""

    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its HTTP base URL."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> StoreProc:
        """Spawn and wait until its /health answers 200."""
        env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": SECRET}
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        async with httpx.AsyncClient(timeout=1.0) as http:
            async def healthy() -> bool:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"store {self.name} exited with {self.proc.returncode}")
                try:
                    return (await http.get(self.url + "/health")).status_code == 200
                except httpx.HTTPError:
                    return False
            await until(healthy, 30.0, f"store {self.name} healthy")
        return self

    async def stop(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process and wait (off the event loop) for it to exit."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def metrics(self) -> str:
        """Its /metrics text."""
        # NOTE: an internal role's /metrics needs the cluster secret.
        async with httpx.AsyncClient(timeout=5.0, headers={"X-Mooncake-Secret": SECRET}) as http:
            return (await http.get(self.url + "/metrics")).text


def store_proc(index_url: str, name: str, memory: str = "64MiB",
               extra: list[str] | None = None, port: int | None = None) -> StoreProc:
    """A store node process registered with the index at `index_url` (not started yet)."""
    port = port or free_port_block(1)
    return StoreProc(name, [
        sys.executable, "-m", "mooncake_server", "--role", "store", "--port", str(port),
        "--conductor-url", index_url, "--instance-id", name, "--memory", memory,
        "--heartbeat-interval", "0.2", "--transport", "tcp", "--log-level", "warning",
        *(extra or [])], port)
