"""Start mooncake-server process trees on free local ports (tests, benchmarks, trace replay)."""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 240.0


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for port-0 binds and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(base: int, n: int) -> bool:
    for p in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_port_block(n: int) -> int:
    """A base port with `n` consecutive free ports above it.

    Taken below the kernel's ephemeral range: a port found free there cannot be handed, before
    our process binds it, to some listener that asked for port 0 (a store's control channel, a
    transfer engine) or to an outgoing connection.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    if low - n > 10000:
        for _ in range(200):
            base = rng.randrange(10000, low - n)
            if _bindable(base, n):
                return base
    for _ in range(50):  # no room below it: any free block, racy as that is
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and _bindable(base, n):
            return base
    raise RuntimeError("no block of free ports")


@dataclass
class Cluster:
    """A running `mooncake-server` process tree."""

    proc: subprocess.Popen[bytes]
    port: int
    secret: str = ""  # the cluster secret, for reading internal roles' /metrics

    @property
    def internal_headers(self) -> dict[str, str]:
        """Headers that internal endpoints (and internal roles' /metrics) accept."""
        from mooncake_server.wire.auth import secret_headers

        return secret_headers(self.secret)

    @property
    def url(self) -> str:
        """Base URL of the public API."""
        return f"http://127.0.0.1:{self.port}"

    def role_url(self, offset: int) -> str:
        """Base URL of a child role (--role all puts them on port+1..3)."""
        return f"http://127.0.0.1:{self.port + offset}"

    def stop(self) -> int:
        """Ctrl-C the supervisor and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def start_cluster(role: str, extra: list[str] | None = None) -> Cluster:
    """Start `mooncake-server --role ROLE` on free ports and wait until /health answers 200."""
    port = free_port_block(5)
    argv = [sys.executable, "-m", "mooncake_server", "--role", role, "--port", str(port),
            "--kv-memory", "512MiB", "--memory", "1GiB",
            # float32 is the exact mode tests compare with HF; `extra` may override it
            "--dtype", "float32", *(extra or [])]
    secret = secrets.token_hex(16)
    env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": secret}
    proc = subprocess.Popen(argv, start_new_session=True, env=env)
    cluster = Cluster(proc, port, secret)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{role} exited with {proc.returncode} during start-up")
        try:
            if httpx.get(cluster.url + "/health", timeout=2).status_code == 200:
                return cluster
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    cluster.stop()
    raise RuntimeError(f"{role} did not become healthy in {STARTUP_TIMEOUT_S}s")
