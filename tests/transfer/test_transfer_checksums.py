"""Fused checksums: a READ submitted with checksums=True comes back with the CRC32C of the bytes
that landed, computed by the worker that moved them (shm: during the copy; TCP: as they are
received), slices combined in offset order; WRITEs and failed requests get None."""

from __future__ import annotations

import random

import pytest
from transfer_helpers import SECRET, SEG_BYTES, KiB, MiB, Peer, Proxy, address_of

from mooncake_server.transfer import Op, TransferEngine, TransferError, TransferRequest, crc32c

SLICE = 64 * KiB  # the client's slice size: shm and TCP both cut requests at 64 KiB here


def client(transport: str, **kw: object) -> TransferEngine:
    return TransferEngine(secret=SECRET, transport=transport, serve=False, timeout_s=5.0,
                          slice_bytes=SLICE, **kw)  # type: ignore[arg-type]


def opened(engine: TransferEngine, peer: Peer, size: int) -> tuple[memoryview, int, int]:
    """Local registered memory (buffer, base address) and the peer's segment "kv" opened."""
    local = engine.alloc_shared("local", size)
    return local, address_of(local), engine.open_segment(peer.address, "kv")


# lengths around the slice boundaries, several slices, and the empty read
LENGTHS = [1, 7, SLICE - 1, SLICE, SLICE + 1, 3 * SLICE + 17, 10 * SLICE, 0, 767, 768, 100_003]


@pytest.mark.parametrize("verify_crc", [False, True], ids=["plain", "wire-crc"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_each_read_returns_the_crc_of_what_landed(peer: Peer, expected: bytes,
                                                        transport: str, verify_crc: bool) -> None:
    with client(transport, verify_crc=verify_crc) as engine:
        local, base, handle = opened(engine, peer, 4 * MiB)
        assert engine.transport_of(handle) == transport
        rng = random.Random(5)
        reqs, pos = [], 3  # odd local and remote offsets: no alignment to lean on
        for n in LENGTHS:
            reqs.append(TransferRequest(Op.READ, base + pos, handle, rng.randrange(SEG_BYTES - n)
                                        | 1, n))
            pos += n + 5
        sums = await engine.transfer(reqs, checksums=True)
        assert len(sums) == len(reqs)
        for r, got in zip(reqs, sums):
            off = r.local_addr - base
            assert local[off:off + r.length] == expected[r.remote_offset:r.remote_offset + r.length]
            assert got == crc32c(local[off:off + r.length]), r.length
        assert sums[LENGTHS.index(0)] == 0  # the CRC32C of nothing


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_many_small_requests_in_one_batch(peer: Peer, expected: bytes,
                                                transport: str) -> None:
    # small requests to one segment are pipelined as groups on one connection (TCP)
    with client(transport) as engine:
        _, base, handle = opened(engine, peer, 2 * MiB)
        rng = random.Random(11)
        reqs, pos = [], 0
        for _ in range(300):
            n = rng.choice([1, 100, 4096, 5000, 3 * KiB + 1])
            reqs.append(TransferRequest(Op.READ, base + pos, handle, rng.randrange(SEG_BYTES - n),
                                        n))
            pos += n
        sums = await engine.transfer(reqs, checksums=True)
        assert sums == [crc32c(expected[r.remote_offset:r.remote_offset + r.length])
                        for r in reqs]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_batch_api_writes_and_plain_reads_have_none(peer: Peer, expected: bytes,
                                                          transport: str) -> None:
    with client(transport) as engine:
        local, base, handle = opened(engine, peer, 1 * MiB)
        off = 9 * MiB
        local[:200 * KiB] = expected[off:off + 200 * KiB]  # WRITE back what is there already
        batch = engine.allocate_batch(3)
        engine.submit_transfer(batch, [
            TransferRequest(Op.READ, base + 300 * KiB, handle, 1000, 130 * KiB),
            TransferRequest(Op.WRITE, base, handle, off, 200 * KiB),
        ], checksums=True)
        engine.submit_transfer(batch, [TransferRequest(Op.READ, base + 500 * KiB, handle, 0, 10)])
        await engine.wait(batch)
        assert engine.get_checksums(batch) == [crc32c(expected[1000:1000 + 130 * KiB]), None,
                                               None]
        engine.free_batch(batch)
        # without the flag, transfer() keeps returning None
        assert await engine.transfer([TransferRequest(Op.READ, base, handle, 0, 10)]) is None
        assert await engine.transfer([], checksums=True) == []


async def test_failed_request_has_no_checksum(peer: Peer, expected: bytes) -> None:
    with client("tcp") as engine:
        _, base, handle = opened(engine, peer, 1 * MiB)
        batch = engine.allocate_batch(2)
        engine.submit_transfer(batch, [
            TransferRequest(Op.READ, base, handle, 5, 200 * KiB),
            TransferRequest(Op.READ, base + 512 * KiB, handle, SEG_BYTES - 10, 100),  # past end
        ], checksums=True)
        with pytest.raises(TransferError, match="out of bounds"):
            await engine.wait(batch)
        assert engine.get_checksums(batch) == [crc32c(expected[5:5 + 200 * KiB]), None]
        engine.free_batch(batch)


async def test_checksum_reflects_bytes_corrupted_in_transit(peer: Peer, expected: bytes) -> None:
    # one byte of every server->client stream inverted, no wire CRC: the landed bytes are wrong,
    # and the fused checksum says so (it is of what landed, not of what the peer holds)
    proxy = Proxy(peer.address, flip_at=8192)
    try:
        with client("tcp") as engine:
            local = engine.alloc_shared("local", 1 * MiB)
            handle = engine.open_segment(proxy.address, "kv")
            [got] = await engine.transfer([TransferRequest(Op.READ, address_of(local), handle,
                                                           0, 1 * MiB)], checksums=True)
            assert local[:] != expected[:1 * MiB]
            assert got == crc32c(local) != crc32c(expected[:1 * MiB])
    finally:
        proxy.close()
