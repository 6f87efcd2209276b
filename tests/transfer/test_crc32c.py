"""CRC32C: known vectors, buffer vs address forms, the three-stream hardware path against the
table implementation at every length and alignment, and the batch form."""

from __future__ import annotations

import ctypes
import os
import random

import pytest

from mooncake_server.transfer import _native, crc32c, crc32c_many

# the hardware path's chunk sizes (native/te_crc32c.c): blocks are 3 chunks, merged by shifts
CHUNKS = (256, 4096, 32768)


def _addr(buf: bytearray) -> int:
    """The address of a bytearray's bytes (0 for an empty one, which has none)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(20240611).randbytes(3 * 3 * CHUNKS[-1] + 4096)


def test_known_vectors() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    # iSCSI (RFC 3720) test patterns
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def test_address_form_matches_buffer_form() -> None:
    data = bytearray(os.urandom(100_003))
    addr = _addr(data)
    assert crc32c(addr, len(data)) == crc32c(data) == crc32c(memoryview(data))
    assert crc32c(addr + 7, 1000) == crc32c(bytes(data[7:1007]))


def test_hardware_matches_table_for_every_short_length(data: bytes) -> None:
    view = memoryview(data)
    for n in range(1101):
        off = n % 16  # every alignment, across the single-chain / three-stream switch at 768
        assert crc32c(view[off:off + n]) == _native.crc32c_software(view[off:off + n]), n


def test_hardware_matches_table_at_block_boundaries(data: bytes) -> None:
    view, copy = memoryview(data), bytearray(data)
    base = _addr(copy)
    lengths = {k * 3 * c + d for c in CHUNKS for k in (1, 2, 3) for d in (-1, 0, 1)}
    lengths |= {3 * CHUNKS[2] + 3 * CHUNKS[1] + 3 * CHUNKS[0] + 767}  # every tier, then a tail
    for n in sorted(lengths):
        for off in range(16):
            got = crc32c(view[off:off + n])
            assert got == _native.crc32c_software(view[off:off + n]), (n, off)
            assert got == _native.crc32c_addr_serial(base + off, n) == crc32c(base + off, n)


def test_hardware_matches_table_at_random_lengths(data: bytes) -> None:
    rng = random.Random(7)
    view = memoryview(data)
    for _ in range(150):
        n, off = rng.randrange(70_001), rng.randrange(16)
        assert crc32c(view[off:off + n]) == _native.crc32c_software(view[off:off + n]), (n, off)


@pytest.mark.parametrize("size", [5, 1000, 200_000])
def test_seed_continues_a_crc(data: bytes, size: int) -> None:
    head, tail = data[:size // 3], data[size // 3:size]
    assert _native.crc32c(tail, crc32c(head)) == crc32c(head + tail)
    assert _native.crc32c_software(tail, crc32c(head)) == crc32c(head + tail)


def test_crc32c_many_equals_per_buffer_crc32c() -> None:
    rng = random.Random(3)
    buffers = [bytearray(rng.randbytes(n)) for n in (0, 1, 767, 768, 4096, 70_001, 1 << 20)]
    addrs, sizes = [_addr(b) for b in buffers], [len(b) for b in buffers]
    assert crc32c_many(addrs, sizes) == [crc32c(bytes(b)) for b in buffers]
    # a small batch (the GIL is kept) and an empty one
    assert crc32c_many(addrs[:3], sizes[:3]) == [crc32c(bytes(b)) for b in buffers[:3]]
    assert crc32c_many([], []) == []


def test_crc32c_many_rejects_bad_input() -> None:
    buf = bytearray(64)
    with pytest.raises(ValueError, match="2 addresses but 1 sizes"):
        crc32c_many([_addr(buf), _addr(buf)], [64])
    with pytest.raises(ValueError, match="negative"):
        crc32c_many([_addr(buf)], [-1])
    with pytest.raises(ValueError, match="NULL"):
        crc32c_many([0], [8])
    with pytest.raises(TypeError):
        crc32c_many([float(_addr(buf))], [8])  # type: ignore[list-item]


def test_address_without_length_is_rejected() -> None:
    with pytest.raises(TypeError):
        crc32c(12345)
