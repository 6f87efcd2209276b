"""GET by key: an engine serves published objects in one round trip, pinned while it sends them."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest
from transfer_helpers import (
    FRAME_MAGIC,
    REQ_HDR,
    RESP_HDR,
    SECRET,
    MiB,
    address_of,
    client_handshake,
)

from mooncake_server.transfer import TransferEngine, TransferError, crc32c

OP_GET = 6
POOL = 48 * MiB


@pytest.fixture
def owner() -> Iterator[tuple[TransferEngine, memoryview]]:
    """A serving engine with a pool of random bytes (segment "pool")."""
    engine = TransferEngine(secret=SECRET, transport="tcp")
    pool = engine.alloc_shared("pool", POOL)
    pool[:] = os.urandom(POOL)
    yield engine, pool
    engine.close()


@pytest.fixture
def reader() -> Iterator[tuple[TransferEngine, memoryview]]:
    """A client engine (TCP only) with registered memory to land objects in."""
    engine = TransferEngine(secret=SECRET, serve=False, transport="tcp")
    dst = engine.alloc_shared("dst", POOL)
    yield engine, dst
    engine.close()


async def test_get_lands_the_published_bytes_and_misses_what_is_not_published(
        owner: tuple[TransferEngine, memoryview], reader: tuple[TransferEngine, memoryview]) -> None:
    eng, pool = owner
    big, small = (4096, MiB + 123), (3 * MiB, 64 << 10)  # (offset, length): sliced, and not
    for key, (off, n) in (("big", big), ("small", small)):
        eng.publish(key, "pool", off, n, crc32c(pool[off:off + n]), off)
    assert eng.published == 2
    client, dst = reader
    seg = await client.open_segment_async(eng.address, "pool")
    base = address_of(dst)
    got = await client.get_published(seg, [("big", base, big[1]), ("absent", base + 4 * MiB, 10),
                                           ("small", base + 2 * MiB, small[1])])
    assert got[1] is None  # a miss is an answer, not a failure
    for obj, (off, n), at in ((got[0], big, 0), (got[2], small, 2 * MiB)):
        assert obj is not None and obj.length == n
        assert obj.stored_crc == obj.landed_crc == crc32c(pool[off:off + n])
        assert bytes(dst[at:at + n]) == bytes(pool[off:off + n])
    # Each object read counts once for the owner's LRU and hits (not once per slice).
    assert dict(eng.take_touched()) == {"big": 1, "small": 1}
    assert eng.take_touched() == []


async def test_a_reader_expecting_another_length_is_refused_by_name(
        owner: tuple[TransferEngine, memoryview], reader: tuple[TransferEngine, memoryview]) -> None:
    eng, pool = owner
    eng.publish("k", "pool", 0, MiB, crc32c(pool[:MiB]), 0)
    client, dst = reader
    seg = await client.open_segment_async(eng.address, "pool")
    with pytest.raises(TransferError, match=r"'k' is 1048576 bytes, the reader expects 65536"):
        await client.get_published(seg, [("k", address_of(dst), 64 << 10)])
    with pytest.raises(ValueError, match="no segment named 'nope'"):
        eng.publish("x", "nope", 0, 1, 0, 0)
    with pytest.raises(ValueError, match="does not fit"):
        eng.publish("x", "pool", POOL - 10, 11, 0, 0)


def _stalled_get(address: str, key: str, length: int) -> socket.socket:
    """A hand-made GET whose reader takes the answer's header and then stops reading."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect((host, int(port)))
    assert client_handshake(sock, SECRET)[0] == 0
    name = key.encode()
    sock.sendall(REQ_HDR.pack(FRAME_MAGIC, OP_GET, len(name), 0, 0, 0, length, length, 0) + name)
    magic, status, n, _crc, _ = RESP_HDR.unpack(sock.recv(RESP_HDR.size, socket.MSG_WAITALL))
    assert (magic, status, n) == (FRAME_MAGIC, 0, length)
    return sock


async def test_retired_bytes_stay_pinned_until_the_get_sending_them_is_done(
        owner: tuple[TransferEngine, memoryview], reader: tuple[TransferEngine, memoryview]) -> None:
    eng, pool = owner
    n = 40 * MiB  # far more than the socket buffers: the owner's send blocks on the reader
    eng.publish("held", "pool", 0, n, crc32c(pool[:n]), 77)
    eng.publish("idle", "pool", 41 * MiB, MiB, crc32c(pool[41 * MiB:42 * MiB]), 41 * MiB)
    sock = _stalled_get(eng.address, "held", n)
    try:
        assert eng.retire("idle", 41 * MiB) is True  # nobody sends it: free at once
        assert eng.retire("held", 77) is False  # being sent: its bytes stay put
        assert eng.retire("held", 77) is False  # asking again changes nothing
        assert eng.published == 0 and eng.take_drained() == []
        client, dst = reader
        seg = await client.open_segment_async(eng.address, "pool")
        assert await client.get_published(seg, [("held", address_of(dst), n)]) == [None]
        received = bytearray()
        while len(received) < n:
            chunk = sock.recv(4 * MiB)
            assert chunk, "owner closed the connection"
            received += chunk
        assert bytes(received) == bytes(pool[:n])
    finally:
        sock.close()
    deadline = asyncio.get_running_loop().time() + 10
    drained: list[int] = []
    while not drained and asyncio.get_running_loop().time() < deadline:
        drained = eng.take_drained()  # the owner's thread lets go right after its last byte
        await asyncio.sleep(0.01)
    assert drained == [77]
    assert eng.retire("held", 77) is True
