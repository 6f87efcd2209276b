"""Shared helpers for the transfer-engine tests: a peer process serving seeded segments, raw
wire-format constants, and a TCP proxy that can cut or corrupt the connections through it."""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import multiprocessing as mp
import os
import random
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mooncake_server.transfer import TransferEngine, crc32c

SECRET = b"test-cluster-secret"
SEG_BYTES = 32 << 20
SEED = 1234
KiB, MiB = 1 << 10, 1 << 20

# wire format (native/te.h), for tests that speak it by hand
HELLO = b"MCTEHS02"
FRAME_MAGIC = 0x3254434D
OP_INFO, OP_READ, OP_WRITE = 1, 2, 3
REQ_HDR = struct.Struct("<IBBBBQQII")  # magic, op, name_len, flags, pad, offset, length, crc, pad
RESP_HDR = struct.Struct("<IIQII")  # magic, status, length, crc, pad
INFO_BODY = struct.Struct("<QIiQQ40sQII")  # size, pid, fd, dev, ino, boot id, rdma addr/rkey/ok


def _serve(conn: Connection, secret: bytes, size: int, seed: int) -> None:
    """Peer process: one shared segment 'kv' (seeded bytes) and one plain segment 'plain'."""
    engine = TransferEngine(secret=secret, timeout_s=5.0)
    seg = engine.alloc_shared("kv", size)
    seg[:] = random.Random(seed).randbytes(size)
    plain = bytearray(random.Random(seed + 1).randbytes(1 * MiB))
    engine.register_memory("plain", plain)
    conn.send((engine.address, os.getpid()))
    try:
        while True:
            cmd, off, n = conn.recv()
            if cmd == "crc":
                conn.send(crc32c(seg[off:off + n]))
            elif cmd == "stop":
                break
    except EOFError:
        pass
    engine.close()


@dataclass
class Peer:
    """A running peer process and how to reach it."""

    proc: Any
    conn: Connection
    address: str
    pid: int

    def crc(self, off: int, n: int) -> int:
        """CRC32C of the peer's 'kv' bytes [off, off + n), as the peer sees them."""
        self.conn.send(("crc", off, n))
        if not self.conn.poll(10):
            raise TimeoutError("peer did not answer")
        return int(self.conn.recv())

    def stop(self) -> None:
        """Stop the peer process (resuming it first if it was stopped)."""
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.conn.send(("stop", 0, 0))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def start_peer() -> Peer:
    """Spawn a peer process and wait (with a deadline) until it serves."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, SECRET, SEG_BYTES, SEED), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while not parent.poll(0.05):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"peer process did not start (exit code {proc.exitcode})")
    address, pid = parent.recv()
    return Peer(proc, parent, address, pid)


def address_of(mv: memoryview | bytearray) -> int:
    """Absolute address of a writable buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def client_handshake(sock: socket.socket, secret: bytes) -> bytes:
    """Answer the server's challenge by hand; returns its 33-byte verdict."""
    hello = sock.recv(40, socket.MSG_WAITALL)
    assert hello[:8] == HELLO
    cn = os.urandom(32)
    sock.sendall(cn + hmac.new(secret, b"mcte-client" + hello[8:] + cn, hashlib.sha256).digest())
    return sock.recv(33, socket.MSG_WAITALL)


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Play the server's side of the handshake by hand (for fake peers)."""
    sn = os.urandom(32)
    sock.sendall(HELLO + sn)
    answer = sock.recv(64, socket.MSG_WAITALL)
    cn, proof = answer[:32], answer[32:]
    if not hmac.compare_digest(proof, hmac.new(secret, b"mcte-client" + sn + cn,
                                               hashlib.sha256).digest()):
        raise ConnectionError("client failed the handshake")
    sock.sendall(b"\x00" + hmac.new(secret, b"mcte-server" + sn + cn, hashlib.sha256).digest())


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of `target` that can break or corrupt connections.

    cut_connections / cut_after: the first N connections are closed once `cut_after` bytes went
    server -> client. flip_at / flip_up: every connection has the byte at that offset of its
    server -> client stream (client -> server when flip_up) inverted.
    """

    def __init__(self, target: str, *, cut_connections: int = 0, cut_after: int = 0,
                 flip_at: int | None = None, flip_up: bool = False) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._cut_connections, self._cut_after = cut_connections, cut_after
        self._flip_at, self._flip_up = flip_at, flip_up
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._target)
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks += [down, up]
            cut = self._cut_after if index < self._cut_connections else None
            threading.Thread(target=self._pump, args=(up, down, cut, not self._flip_up),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(down, up, None, self._flip_up),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cut: int | None,
              flip: bool) -> None:
        buf = bytearray(256 * KiB)
        sent = 0
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                chunk = memoryview(buf)[:n]
                if flip and self._flip_at is not None and sent <= self._flip_at < sent + n:
                    chunk[self._flip_at - sent] ^= 0xFF
                if cut is not None and sent + n >= cut:
                    dst.sendall(chunk[:cut - sent])
                    break
                dst.sendall(chunk)
                sent += n
        except OSError:
            pass
        for s in (src, dst):  # either side ending ends the connection, like a dead link would
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop accepting and drop every proxied connection."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
