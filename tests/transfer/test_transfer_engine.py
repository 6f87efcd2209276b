"""Transfer engine across real processes: shm and TCP data paths (with and without per-slice
CRC32C), authentication, bounds, malformed frames, and peers that die or go silent mid-batch."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time

import pytest
from transfer_helpers import (
    SECRET,
    SEED,
    SEG_BYTES,
    KiB,
    MiB,
    Peer,
    address_of,
    client_handshake,
    start_peer,
)

from mooncake_server.transfer import Op, TransferEngine, TransferError, TransferRequest, crc32c

# (remote offset, length), disjoint: 64 KiB .. 16 MiB, aligned and not, up to the very end
RANGES = [(0, 64 * KiB), (70_001, 1 * MiB + 777), (5 * MiB, 16 * MiB), (SEG_BYTES - 3 * MiB,
                                                                         3 * MiB)]


@pytest.mark.parametrize("verify_crc", [False, True], ids=["plain", "crc"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_read_and_write_across_processes(peer: Peer, expected: bytes, transport: str,
                                               verify_crc: bool) -> None:
    with TransferEngine(secret=SECRET, transport=transport, serve=False, timeout_s=5.0,
                        slice_bytes=256 * KiB, verify_crc=verify_crc) as client:
        local = client.alloc_shared("local", 24 * MiB)
        base = address_of(local)
        handle = await client.open_segment_async(peer.address, "kv")
        assert client.transport_of(handle) == transport
        assert client.segment_size(handle) == SEG_BYTES

        reads, pos = [], 0
        for off, n in RANGES:
            reads.append((pos, off, n))
            pos += n
        await client.transfer([TransferRequest(Op.READ, base + p, handle, off, n)
                               for p, off, n in reads])
        for p, off, n in reads:
            assert local[p:p + n] == expected[off:off + n]

        rng = random.Random(99)
        for p, off, n in reads:
            local[p:p + n] = rng.randbytes(n)
        batch = client.allocate_batch(len(reads))
        client.submit_transfer(batch, [TransferRequest(Op.WRITE, base + p, handle, off, n)
                                       for p, off, n in reads])
        await client.wait(batch)
        assert all(client.get_transfer_status(batch, i).state.name == "DONE"
                   for i in range(len(reads)))
        client.free_batch(batch)
        # the bytes landed in the peer's memory, as the peer itself sees them
        for p, off, n in reads:
            assert peer.crc(off, n) == crc32c(local[p:p + n])
        # put the original bytes back (synchronous API this time) for the other tests
        for p, off, n in reads:
            local[p:p + n] = expected[off:off + n]
        batch = client.allocate_batch(len(reads))
        client.submit_transfer(batch, [TransferRequest(Op.WRITE, base + p, handle, off, n)
                                       for p, off, n in reads])
        client.wait_sync(batch)
        client.free_batch(batch)
        assert all(peer.crc(off, n) == crc32c(expected[off:off + n]) for _, off, n in reads)


async def test_plain_registered_memory_is_served_over_tcp(peer: Peer) -> None:
    with TransferEngine(secret=SECRET, serve=False) as client:
        local = bytearray(1 * MiB)
        client.register_memory("local", local)
        handle = client.open_segment(peer.address, "plain")
        assert client.transport_of(handle) == "tcp"  # auto falls back: not shared memory
        await client.transfer([TransferRequest(Op.READ, address_of(memoryview(local)), handle,
                                               0, 1 * MiB)])
        assert local == random.Random(SEED + 1).randbytes(1 * MiB)


async def test_wrong_secret_is_refused(peer: Peer) -> None:
    with TransferEngine(secret=b"not-the-secret", serve=False) as intruder:
        with pytest.raises(TransferError, match="authentication failed") as info:
            intruder.open_segment(peer.address, "kv")
        assert peer.address in str(info.value)
    with TransferEngine(secret=SECRET, serve=False) as client:  # the server still serves
        assert client.segment_size(client.open_segment(peer.address, "kv")) == SEG_BYTES


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_out_of_bounds_fails_clearly_and_peer_keeps_serving(
        peer: Peer, expected: bytes, transport: str) -> None:
    with TransferEngine(secret=SECRET, transport=transport, serve=False,
                        connections_per_peer=1) as client:
        local = client.alloc_shared("local", 2 * MiB)
        base = address_of(local)
        handle = client.open_segment(peer.address, "kv")
        for op in (Op.READ, Op.WRITE):  # a refused WRITE must not desync the connection
            with pytest.raises(TransferError, match="out of bounds") as info:
                await client.transfer([TransferRequest(op, base, handle, SEG_BYTES - 100,
                                                       1 * MiB)])
            assert "'kv'" in str(info.value)
        await client.transfer([TransferRequest(Op.READ, base, handle, 777, 2 * MiB)])
        assert local[:] == expected[777:777 + 2 * MiB]
        with pytest.raises(TransferError, match="no segment named 'missing'"):
            client.open_segment(peer.address, "missing")


def test_local_range_must_be_registered(peer: Peer) -> None:
    with TransferEngine(secret=SECRET, serve=False) as client:
        local = client.alloc_shared("local", 64 * KiB)
        handle = client.open_segment(peer.address, "kv")
        batch = client.allocate_batch(1)
        with pytest.raises(ValueError, match="not inside memory registered"):
            client.submit_transfer(batch, [TransferRequest(Op.READ, address_of(local) + 1,
                                                           handle, 0, 64 * KiB)])
        client.free_batch(batch)


def test_malformed_frames_close_only_that_connection(peer: Peer, expected: bytes) -> None:
    host, port = peer.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        reply = client_handshake(sock, SECRET)
        assert reply[0] == 0  # accepted: the garbage below comes from an authenticated peer
        sock.sendall(os.urandom(32))
        assert sock.recv(1) == b""  # server hung up
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        assert client_handshake(sock, b"wrong")[:1] == b"\x01"
    with TransferEngine(secret=SECRET, transport="tcp", serve=False) as client:
        local = client.alloc_shared("local", 64 * KiB)
        handle = client.open_segment(peer.address, "kv")
        b = client.allocate_batch(1)
        client.submit_transfer(b, [TransferRequest(Op.READ, address_of(local), handle, 0,
                                                   64 * KiB)])
        client.wait_sync(b)
        client.free_batch(b)
        assert local[:] == expected[:64 * KiB]


async def _wait_counting_ticks(client: TransferEngine, batch: int) -> tuple[BaseException,
                                                                              float, int]:
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    start = time.monotonic()
    try:
        await client.wait(batch)
    except TransferError as exc:
        return exc, time.monotonic() - start, ticks
    finally:
        stop.set()
        await task
    raise AssertionError("the batch should have failed")


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "silent"])
async def test_dead_peer_fails_batch_within_timeout(peer: Peer, expected: bytes,
                                                   kill: bool) -> None:
    victim = start_peer()
    timeout_s = 2.0
    try:
        with TransferEngine(secret=SECRET, transport="tcp", serve=False,
                            timeout_s=timeout_s) as client:
            local = client.alloc_shared("local", 16 * MiB)
            base = address_of(local)
            doomed = client.open_segment(victim.address, "kv")
            alive = client.open_segment(peer.address, "kv")

            os.kill(victim.pid, signal.SIGSTOP)  # the batch is surely in flight when it dies
            batch = client.allocate_batch(8)
            client.submit_transfer(batch, [TransferRequest(Op.READ, base, doomed, i * MiB,
                                                           16 * MiB) for i in range(8)])
            assert client.get_transfer_status(batch, 0).state.name == "PENDING"
            if kill:
                os.kill(victim.pid, signal.SIGKILL)
            exc, elapsed, ticks = await _wait_counting_ticks(client, batch)
            assert elapsed < timeout_s + 1.5
            assert victim.address in str(exc)
            if not kill:  # a silent peer is detected by the timeout, a killed one at once
                assert "timeout" in str(exc)
                assert ticks > 10  # the event loop kept running while the batch waited
            assert client.get_transfer_status(batch, 7).state.name == "FAILED"
            client.free_batch(batch)

            await client.transfer([TransferRequest(Op.READ, base, alive, 4096, 16 * MiB)])
            assert local[:] == expected[4096:4096 + 16 * MiB]
    finally:
        victim.proc.kill()
        victim.proc.join(5)




@pytest.mark.parametrize("verify_crc", [False, True], ids=["plain", "crc"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_many_small_requests_and_one_bad_one(peer: Peer, expected: bytes, transport: str,
                                                   verify_crc: bool) -> None:
    # small requests are pipelined together on one connection: each must still land, and a bad
    # one among them must fail alone without desynchronising the others
    with TransferEngine(secret=SECRET, transport=transport, serve=False,
                        verify_crc=verify_crc) as client:
        local = client.alloc_shared("local", 1 * MiB)
        base = address_of(local)
        handle = client.open_segment(peer.address, "kv")
        rng = random.Random(5)
        reads = [(i * 8 * KiB, rng.randrange(0, SEG_BYTES - 8 * KiB), 8 * KiB - i % 7)
                 for i in range(100)]
        await client.transfer([TransferRequest(Op.READ, base + p, handle, off, n)
                               for p, off, n in reads])
        for p, off, n in reads:
            assert local[p:p + n] == expected[off:off + n]

        local[:] = bytes(1 * MiB)
        bad = 17
        batch = client.allocate_batch(40)
        client.submit_transfer(batch, [
            TransferRequest(Op.READ, base + p, handle, SEG_BYTES - 10 if i == bad else off, n)
            for i, (p, off, n) in enumerate(reads[:40])])
        with pytest.raises(TransferError, match="out of bounds"):
            await client.wait(batch)
        states = [client.get_transfer_status(batch, i).state.name for i in range(40)]
        assert states == ["FAILED" if i == bad else "DONE" for i in range(40)]
        client.free_batch(batch)
        for i, (p, off, n) in enumerate(reads[:40]):
            assert i == bad or local[p:p + n] == expected[off:off + n]
