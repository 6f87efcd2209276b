"""CRC32C: known vectors, buffer vs address forms, the three-stream hardware path against the
table implementation at every length and alignment, the batch form, the one-pass copy + CRC of
the shm transport, and combining the CRCs of adjacent pieces."""

from __future__ import annotations

import ctypes
import os
import random

import pytest

from mooncake_server.transfer import _native, crc32c, crc32c_combine, crc32c_many

# the hardware path's chunk sizes (native/te_crc32c.c): blocks are 3 chunks, merged by shifts
CHUNKS = (256, 4096, 32768)


def _addr(buf: bytearray) -> int:
    """The address of a bytearray's bytes (0 for an empty one, which has none)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(20240611).randbytes(3 * 3 * CHUNKS[-1] + 4096 + (256 << 10))


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


def test_combine_equals_crc_of_the_concatenation(data: bytes) -> None:
    rng = random.Random(12)
    lengths = [0, 1, 2, 7, 8, 255, 256, 767, 768, 4095, 4096, 65_535, 65_536, 65_537, 262_144,
               100_003]
    for la in lengths:
        for lb in lengths:
            a, b = data[:la], data[la:la + lb]
            assert len(a) + len(b) == la + lb
            assert crc32c_combine(crc32c(a), crc32c(b), lb) == crc32c(a + b), (la, lb)
    # many pieces folded left to right, as the engine folds a request's slices
    pieces, pos = [], 0
    for _ in range(40):
        n = rng.choice([0, 1, 13, 4096, 65_536, rng.randrange(100_000)])
        pieces.append(data[pos:pos + n])
        pos = (pos + n) % (len(data) // 2)
    crc = 0
    for piece in pieces:
        crc = crc32c_combine(crc, crc32c(piece), len(piece))
    assert crc == crc32c(b"".join(pieces))


def test_combine_over_huge_lengths_is_associative() -> None:
    # lengths no test can materialise: (A|B)|C == A|(B|C), with B and C gigabytes long
    a, b, c = 0x12345678, 0x9ABCDEF0, 0x0F1E2D3C
    nb, nc = (5 << 30) + 3, (1 << 40) + 12345
    left = crc32c_combine(crc32c_combine(a, b, nb), c, nc)
    right = crc32c_combine(a, crc32c_combine(b, c, nc), nb + nc)
    assert left == right
    assert crc32c_combine(a, 0, 0) == a  # appending nothing changes nothing


def test_combine_rejects_out_of_range_values() -> None:
    with pytest.raises(ValueError, match="32-bit"):
        crc32c_combine(1 << 32, 0, 1)
    with pytest.raises(ValueError, match="length"):
        crc32c_combine(0, 0, -1)


def _copy_case(src: bytearray, dst: bytearray, s_off: int, d_off: int, n: int) -> None:
    dst[:] = bytes(len(dst))
    got = _native.crc32c_copy_addr(_addr(dst) + d_off, _addr(src) + s_off, n)
    assert dst[d_off:d_off + n] == src[s_off:s_off + n], (n, s_off, d_off)
    assert not any(dst[:d_off]) and not any(dst[d_off + n:]), (n, s_off, d_off)  # no overrun
    assert got == _native.crc32c_software(bytes(src[s_off:s_off + n])), (n, s_off, d_off)


def test_copy_with_crc_at_every_short_length(data: bytes) -> None:
    src, dst = bytearray(data[:1200]), bytearray(1200)
    for n in range(1101):
        _copy_case(src, dst, n % 16, (n * 7) % 16, n)  # source and destination misaligned apart


def test_copy_with_crc_at_block_boundaries(data: bytes) -> None:
    src, dst = bytearray(data), bytearray(len(data))
    lengths = {k * 3 * c + d for c in CHUNKS for k in (1, 2) for d in (-1, 0, 1)}
    lengths |= {3 * CHUNKS[2] + 3 * CHUNKS[1] + 3 * CHUNKS[0] + 767, 256 * 1024}
    for n in sorted(lengths):
        for s_off, d_off in ((0, 0), (1, 0), (0, 9), (15, 3)):
            _copy_case(src, dst, s_off, d_off, n)
