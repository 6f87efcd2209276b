"""Free local ports for servers under test: a block of consecutive ports for a process tree that
binds them itself, or a bound socket an in-process server takes over."""

from __future__ import annotations

import random
import socket
from pathlib import Path


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


def bound_socket() -> tuple[socket.socket, int]:
    """A TCP socket bound to a free 127.0.0.1 port (held, so no one else takes it), and the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]
