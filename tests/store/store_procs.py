"""Store test rigs: the real store-index routes served in-process, store nodes as OS processes
(testkit's `serve_app` and `RoleProc`, driven from async tests)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi import FastAPI

from mooncake_server.roles.conductor.registry import InstanceRegistry, registry_router
from mooncake_server.roles.master.master import (
    StoreMaster,
    master_router,
    serve_index_channel,
)
from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_server.wire.rpc import RpcServer
from mooncake_testkit.in_process import serve_app
from mooncake_testkit.role_procs import RoleCluster, RoleProc

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
    try:
        async with serve_app(app) as url:
            yield IndexServer(url, master, registry, channel)
    finally:
        await channel.close()


@dataclass
class StoreProc:
    """One store node process (`RoleProc`), started, stopped and read without blocking the loop."""

    role: RoleProc

    @property
    def name(self) -> str:
        """Its instance id."""
        return self.role.name

    @property
    def port(self) -> int:
        """Its HTTP port (a restart may reuse it)."""
        return self.role.port

    @property
    def url(self) -> str:
        """Its HTTP base URL."""
        return self.role.url

    async def start(self) -> StoreProc:
        """Spawn and wait until its /health answers 200."""
        await asyncio.to_thread(lambda: self.role.start().wait_healthy(30.0))
        return self

    async def stop(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process and wait (off the event loop) for it to exit."""
        if sig == signal.SIGKILL:
            await asyncio.to_thread(self.role.kill)
        else:
            await asyncio.to_thread(self.role.stop, 20.0, sig)

    async def metrics(self) -> str:
        """Its /metrics text."""
        # NOTE: an internal role's /metrics needs the cluster secret.
        async with httpx.AsyncClient(timeout=5.0, headers=HEADERS) as http:
            return (await http.get(self.url + "/metrics")).text


def store_proc(index_url: str, name: str, memory: str = "64MiB",
               extra: list[str] | None = None, port: int | None = None) -> StoreProc:
    """A store node process registered with the index at `index_url` (not started yet)."""
    nodes = RoleCluster(secret=SECRET, conductor_url=index_url)
    return StoreProc(nodes.add(
        "store", name, "--memory", memory, "--heartbeat-interval", "0.2", "--transport", "tcp",
        "--log-level", "warning", *(extra or []), port=port))
