"""A store-only cluster for the Mooncake API tests: a standalone master (`--role master`) and
store nodes registered with it (`--role store --master`), each its own OS process."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from mooncake_server.mooncake_api import MooncakeDistributedStore
from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_testkit.ports import free_port_block
from mooncake_testkit.role_procs import RoleProc


@dataclass
class StoreOnly:
    """A master and its store nodes."""

    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    master: RoleProc | None = None
    nodes: dict[str, RoleProc] = field(default_factory=dict)

    @property
    def master_addr(self) -> str:
        """host:port of the master, as Mooncake clients give it."""
        assert self.master is not None
        return f"127.0.0.1:{self.master.port}"

    def _proc(self, role: str, name: str, *extra: str) -> RoleProc:
        port = free_port_block(1)
        argv = [sys.executable, "-m", "mooncake_server", "--role", role, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", *extra]
        env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": self.secret}
        return RoleProc(role, name, "127.0.0.1", port, argv, env)

    def start_master(self, *extra: str) -> RoleProc:
        """Start the master and wait for its /health."""
        self.master = self._proc("master", "master", *extra).start().wait_healthy(60.0)
        return self.master

    def add_node(self, name: str, memory: str = "64MiB", *extra: str) -> RoleProc:
        """Start a store node registered with the master; wait until the master counts it."""
        want = self.stores() + 1
        node = self._proc("store", name, "--master", self.master_addr, "--instance-id", name,
                          "--memory", memory, "--transport", "tcp",
                          "--heartbeat-interval", "0.2", *extra).start().wait_healthy(60.0)
        self.nodes[name] = node
        self.wait(lambda: self.stores() >= want, f"{name} registered")
        return node

    def stores(self) -> int:
        """Live store nodes the master counts."""
        assert self.master is not None
        return int(httpx.get(self.master.url + "/health", timeout=5).json()["stores"])

    def metric(self, proc: RoleProc, name: str) -> float:
        """Sum of a metric's samples on one process."""
        text = httpx.get(proc.url + "/metrics", headers={SECRET_HEADER: self.secret},
                         timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    @staticmethod
    def wait(predicate: object, what: str, timeout_s: float = 30.0) -> None:
        """Poll `predicate` until truthy, or fail naming `what`."""
        deadline = time.monotonic() + timeout_s
        while not predicate():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s}s")
            time.sleep(0.05)

    def client(self, segment: int = 0, local_buffer: int = 16 << 20) -> MooncakeDistributedStore:
        """A set-up client (pure when `segment` is 0), with this cluster's secret."""
        os.environ["MOONCAKE_CLUSTER_SECRET"] = self.secret
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, local_buffer, "tcp", "",
                         self.master_addr)
        assert rc == 0, f"setup failed: {rc}"
        return store

    def stop(self) -> None:
        """Stop every process."""
        for proc in [*self.nodes.values(), *([self.master] if self.master else [])]:
            if proc.running():
                proc.kill()


@contextmanager
def store_only(nodes: int = 1, memory: str = "64MiB", *master_args: str) -> Iterator[StoreOnly]:
    """A running master with `nodes` store nodes."""
    cluster = StoreOnly()
    try:
        cluster.start_master(*master_args)
        for i in range(nodes):
            cluster.add_node(f"store-{i}", memory)
        yield cluster
    finally:
        cluster.stop()
