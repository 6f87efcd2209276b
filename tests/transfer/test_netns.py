"""TCP across two network namespaces joined by a veth pair (root and `ip netns` needed): bytes
compared both ways, a peer killed mid-batch, and the link taken down mid-batch. Only inside
namespaces does a dead path behave like a real one (from the root namespace of these VMs a
connect() to an unreachable address "succeeds")."""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_server.transfer import crc32c

AGENT = str(Path(__file__).with_name("netns_agent.py"))
SEG_BYTES, SEED, TIMEOUT_S = 32 << 20, 4321, 2.0  # as in netns_agent.py
MiB = 1 << 20
NS_A, NS_B = f"mcte{os.getpid()}a", f"mcte{os.getpid()}b"
VETH_A, VETH_B = f"mv{os.getpid()}a", f"mv{os.getpid()}b"
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"


def _netns_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True,
                          check=False).returncode == 0


pytestmark = pytest.mark.skipif(not _netns_usable(), reason="needs root and `ip netns`")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def netns() -> Iterator[None]:
    """NS_A (ADDR_A) <-veth-> NS_B (ADDR_B); both namespaces removed even if a test fails."""
    try:
        ip("netns", "add", NS_A)
        ip("netns", "add", NS_B)
        ip("link", "add", VETH_A, "netns", NS_A, "type", "veth", "peer", "name", VETH_B,
           "netns", NS_B)
        for ns, dev, addr in ((NS_A, VETH_A, ADDR_A), (NS_B, VETH_B, ADDR_B)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (NS_A, NS_B):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


class Agent:
    """netns_agent.py running inside a namespace, driven by JSON lines."""

    def __init__(self, ns: str, *args: str) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, AGENT, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, request: dict[str, Any] | None = None, timeout: float = 20.0) -> Any:
        assert self.proc.stdin and self.proc.stdout
        if request is not None:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"agent did not answer {request!r} within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent exited (code {self.proc.wait(5)})")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def spawn(netns: None) -> Iterator[Any]:
    agents: list[Agent] = []

    def start(ns: str, *args: str) -> Agent:
        agents.append(Agent(ns, *args))
        return agents[-1]

    yield start
    for agent in agents:
        try:
            os.kill(agent.proc.pid, signal.SIGCONT)
        except OSError:
            pass
        agent.kill()


@pytest.fixture(scope="module")
def expected() -> bytes:
    return random.Random(SEED).randbytes(SEG_BYTES)


def read(client: Agent, handle: int, off: int, n: int, count: int = 1,
         pos: int = 0) -> dict[str, Any]:
    batch = client.ask({"cmd": "submit", "handle": handle, "op": "READ", "off": off, "n": n,
                        "count": count, "pos": pos})["batch"]
    return dict(client.ask({"cmd": "wait", "batch": batch}))


def test_bytes_cross_the_veth_both_ways(spawn: Any, expected: bytes) -> None:
    server = spawn(NS_A, "serve", ADDR_A).ask()
    assert server["address"].startswith(ADDR_A)
    client = spawn(NS_B, "client")
    handle = client.ask({"cmd": "open", "peer": server["address"]})["handle"]

    off, n = 3 * MiB + 17, 16 * MiB
    assert read(client, handle, off, n)["ok"]
    assert client.ask({"cmd": "crc", "pos": 0, "n": n})["crc"] == crc32c(expected[off:off + n])

    written = client.ask({"cmd": "fill", "pos": 0, "n": 8 * MiB, "seed": 7})["crc"]
    batch = client.ask({"cmd": "submit", "handle": handle, "op": "WRITE", "off": 20 * MiB,
                        "n": 8 * MiB, "count": 1})["batch"]
    assert client.ask({"cmd": "wait", "batch": batch})["ok"]
    assert read(client, handle, 20 * MiB, 8 * MiB, pos=64 * MiB)["ok"]  # back, elsewhere
    assert client.ask({"cmd": "crc", "pos": 64 * MiB, "n": 8 * MiB})["crc"] == written


def test_killed_peer_fails_batch_within_timeout(spawn: Any, expected: bytes) -> None:
    victim, live = spawn(NS_A, "serve", ADDR_A), spawn(NS_A, "serve", ADDR_A)
    victim_info, live_info = victim.ask(), live.ask()
    client = spawn(NS_B, "client")
    doomed = client.ask({"cmd": "open", "peer": victim_info["address"]})["handle"]
    alive = client.ask({"cmd": "open", "peer": live_info["address"]})["handle"]

    os.kill(victim_info["pid"], signal.SIGSTOP)  # the batch is surely in flight when it dies
    batch = client.ask({"cmd": "submit", "handle": doomed, "op": "READ", "off": 0, "n": 4 * MiB,
                        "count": 8})["batch"]
    os.kill(victim_info["pid"], signal.SIGKILL)
    result = client.ask({"cmd": "wait", "batch": batch})
    assert not result["ok"] and result["elapsed"] < TIMEOUT_S + 1.5
    assert victim_info["address"] in result["error"]

    assert read(client, alive, MiB, 16 * MiB)["ok"]  # the next batch to a live peer works
    assert client.ask({"cmd": "crc", "pos": 0, "n": 16 * MiB})["crc"] == crc32c(
        expected[MiB:17 * MiB])


def test_link_down_fails_batch_within_timeout(spawn: Any, expected: bytes) -> None:
    server = spawn(NS_A, "serve", ADDR_A)
    info = server.ask()
    client = spawn(NS_B, "client")
    handle = client.ask({"cmd": "open", "peer": info["address"]})["handle"]
    try:
        os.kill(info["pid"], signal.SIGSTOP)  # requests queue up, unanswered...
        batch = client.ask({"cmd": "submit", "handle": handle, "op": "READ", "off": 0,
                            "n": 16 * MiB, "count": 4})["batch"]
        ip("-n", NS_B, "link", "set", VETH_B, "down")
        os.kill(info["pid"], signal.SIGCONT)  # ...and the answers now meet a dead link
        result = client.ask({"cmd": "wait", "batch": batch})
        assert not result["ok"] and result["elapsed"] < TIMEOUT_S + 1.5
        assert info["address"] in result["error"] and "timeout" in result["error"]
    finally:
        os.kill(info["pid"], signal.SIGCONT)
        ip("-n", NS_B, "link", "set", VETH_B, "up")

    deadline = time.monotonic() + 15  # link back: a new batch to the same peer works again
    while not (result := read(client, handle, 5 * MiB, 4 * MiB))["ok"]:
        assert time.monotonic() < deadline, result["error"]
    assert client.ask({"cmd": "crc", "pos": 0, "n": 4 * MiB})["crc"] == crc32c(
        expected[5 * MiB:9 * MiB])
