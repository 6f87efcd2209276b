"""Faults on the wire: a broken connection is retried on another one, per-slice CRC32C catches
corrupted bytes, and truncated streams are refused clearly in both directions."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from transfer_helpers import (
    FRAME_MAGIC,
    INFO_BODY,
    OP_INFO,
    OP_READ,
    OP_WRITE,
    REQ_HDR,
    RESP_HDR,
    SECRET,
    SEG_BYTES,
    MiB,
    Peer,
    Proxy,
    address_of,
    client_handshake,
    server_handshake,
)

from mooncake_server.transfer import Op, TransferEngine, TransferError, TransferRequest, crc32c


@pytest.fixture
def proxy_factory() -> Iterator[list[Proxy]]:
    proxies: list[Proxy] = []
    yield proxies
    for p in proxies:
        p.close()


def tcp_client(**kw: object) -> TransferEngine:
    return TransferEngine(secret=SECRET, transport="tcp", serve=False, timeout_s=3.0,
                          slice_bytes=1 * MiB, **kw)  # type: ignore[arg-type]


async def test_broken_connection_is_retried_on_another(peer: Peer, expected: bytes,
                                                       proxy_factory: list[Proxy]) -> None:
    # the first connection dies in the middle of the third 1 MiB slice
    proxy = Proxy(peer.address, cut_connections=1, cut_after=2 * MiB + 12345)
    proxy_factory.append(proxy)
    with tcp_client(connections_per_peer=1) as client:
        local = client.alloc_shared("local", 8 * MiB)
        handle = client.open_segment(proxy.address, "kv")
        await client.transfer([TransferRequest(Op.READ, address_of(local), handle, 99, 8 * MiB)])
        assert local[:] == expected[99:99 + 8 * MiB]
    assert proxy.connections >= 2  # the batch survived by moving to a fresh connection


async def test_broken_pipeline_of_small_requests_is_retried(peer: Peer, expected: bytes,
                                                            proxy_factory: list[Proxy]) -> None:
    # 64 x 16 KiB go out pipelined; the connection dies after ~6 answers
    proxy = Proxy(peer.address, cut_connections=1, cut_after=100_000)
    proxy_factory.append(proxy)
    with tcp_client(connections_per_peer=1) as client:
        local = client.alloc_shared("local", 1 * MiB)
        base = address_of(local)
        handle = client.open_segment(proxy.address, "kv")
        n = 16 * 1024
        await client.transfer([TransferRequest(Op.READ, base + i * n, handle, 3 * i * n, n)
                               for i in range(64)])
        for i in range(64):
            assert local[i * n:(i + 1) * n] == expected[3 * i * n:(3 * i + 1) * n]
    assert proxy.connections >= 2


async def test_batch_fails_when_every_connection_breaks(peer: Peer,
                                                       proxy_factory: list[Proxy]) -> None:
    proxy = Proxy(peer.address, cut_connections=1000, cut_after=512 * 1024)
    proxy_factory.append(proxy)
    with tcp_client() as client:
        local = client.alloc_shared("local", 8 * MiB)
        handle = client.open_segment(proxy.address, "kv")
        start = time.monotonic()
        with pytest.raises(TransferError, match="retry on a fresh connection") as info:
            await client.transfer([TransferRequest(Op.READ, address_of(local), handle, 0,
                                                   8 * MiB)])
        assert time.monotonic() - start < 3.0
        assert "truncated" in str(info.value) and proxy.address in str(info.value)


async def test_crc_catches_corrupted_read(peer: Peer, expected: bytes,
                                          proxy_factory: list[Proxy]) -> None:
    proxy = Proxy(peer.address, flip_at=8192)  # one byte inverted in every server->client stream
    proxy_factory.append(proxy)
    with tcp_client() as client:  # without CRC the damage goes unnoticed...
        local = client.alloc_shared("local", 1 * MiB)
        handle = client.open_segment(proxy.address, "kv")
        await client.transfer([TransferRequest(Op.READ, address_of(local), handle, 0, 1 * MiB)])
        diff = [i for i in range(1 * MiB) if local[i] != expected[i]]
        assert len(diff) == 1
    with tcp_client(verify_crc=True) as client:  # ...with it, the receiver refuses the slice
        local = client.alloc_shared("local", 1 * MiB)
        handle = client.open_segment(proxy.address, "kv")
        with pytest.raises(TransferError, match="CRC32C mismatch on READ") as info:
            await client.transfer([TransferRequest(Op.READ, address_of(local), handle, 0,
                                                   1 * MiB)])
        assert "retry on a fresh connection" in str(info.value)


async def test_crc_catches_corrupted_write(peer: Peer, expected: bytes,
                                           proxy_factory: list[Proxy]) -> None:
    proxy = Proxy(peer.address, flip_at=8192, flip_up=True)
    proxy_factory.append(proxy)
    off = 20 * MiB
    with tcp_client(verify_crc=True) as client:
        local = client.alloc_shared("local", 1 * MiB)
        local[:] = expected[off:off + 1 * MiB]  # the same bytes: the segment stays as it was
        handle = client.open_segment(proxy.address, "kv")
        with pytest.raises(TransferError, match="CRC32C mismatch on WRITE") as info:
            await client.transfer([TransferRequest(Op.WRITE, address_of(local), handle, off,
                                                   1 * MiB)])
        assert "receiver got" in str(info.value)
        direct = client.open_segment(peer.address, "kv")  # repair what the corrupt slices wrote
        await client.transfer([TransferRequest(Op.WRITE, address_of(local), direct, off,
                                               1 * MiB)])
    assert peer.crc(off, 1 * MiB) == crc32c(expected[off:off + 1 * MiB])


def test_truncated_write_stream_is_dropped(peer: Peer, expected: bytes) -> None:
    host, port = peer.address.rsplit(":", 1)
    off, length = 4 * MiB, 64 * 1024
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        assert client_handshake(sock, SECRET)[0] == 0
        sock.sendall(REQ_HDR.pack(FRAME_MAGIC, OP_WRITE, 2, 0, 0, off, length, 0, 0) + b"kv")
        sock.sendall(expected[off:off + 1000])  # 1000 of the 65536 bytes promised, then EOF
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(RESP_HDR.size) == b""  # never acknowledged: the server hung up
    with TransferEngine(secret=SECRET, transport="tcp", serve=False) as client:
        local = client.alloc_shared("local", length)
        handle = client.open_segment(peer.address, "kv")
        client.wait_sync(_read(client, local, handle, off, length))
        assert local[:] == expected[off:off + length]


def _read(client: TransferEngine, local: memoryview, handle: int, off: int, n: int) -> int:
    batch = client.allocate_batch(1)
    client.submit_transfer(batch, [TransferRequest(Op.READ, address_of(local), handle, off, n)])
    return batch


class TruncatingPeer:
    """A fake engine that passes the handshake and INFO, then sends half of every READ."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                server_handshake(conn, SECRET)
                while True:
                    hdr = conn.recv(REQ_HDR.size, socket.MSG_WAITALL)
                    if len(hdr) < REQ_HDR.size:
                        return
                    _, op, name_len, _, _, _, length, _, _ = REQ_HDR.unpack(hdr)
                    conn.recv(name_len, socket.MSG_WAITALL)
                    if op == OP_INFO:
                        body = INFO_BODY.pack(SEG_BYTES, 1, -1, 0, 0, b"another-host", 0, 0, 0)
                        conn.sendall(RESP_HDR.pack(FRAME_MAGIC, 0, len(body), 0, 0) + body)
                    elif op == OP_READ:
                        conn.sendall(RESP_HDR.pack(FRAME_MAGIC, 0, length, 0, 0))
                        conn.sendall(bytes(length // 2))
                        return  # ...and hang up
            except OSError:
                return

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()


async def test_truncated_read_response_is_refused() -> None:
    fake = TruncatingPeer()
    try:
        with tcp_client() as client:
            local = client.alloc_shared("local", 1 * MiB)
            handle = client.open_segment(fake.address, "kv")
            start = time.monotonic()
            with pytest.raises(TransferError, match="truncated after 524288 of 1048576") as info:
                await client.transfer([TransferRequest(Op.READ, address_of(local), handle, 0,
                                                       1 * MiB)])
            assert time.monotonic() - start < 3.0  # refused at once, not at the timeout
            assert fake.address in str(info.value)
    finally:
        fake.close()


def test_frame_layout_matches_native() -> None:
    # guards the hand-written frames above against silent drift from native/te.h
    assert (REQ_HDR.size, RESP_HDR.size, INFO_BODY.size) == (32, 24, 88)
    assert struct.pack("<I", FRAME_MAGIC) == b"MCT2"
