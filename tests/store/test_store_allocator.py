"""The store's offset allocator: alignment, best fit, coalescing, no creeping fragmentation."""

from __future__ import annotations

import itertools
import random

import pytest

from mooncake_server.roles.store.allocator import ALIGNMENT, OffsetAllocator


def test_offsets_are_aligned_and_disjoint() -> None:
    alloc = OffsetAllocator(1 << 20)
    ranges = []
    for size in (1, 63, 64, 65, 1000, 4096, 7):
        off = alloc.allocate(size)
        assert off is not None and off % ALIGNMENT == 0
        ranges.append((off, off + size))
    ranges.sort()
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end <= start
    assert alloc.used == sum(alloc.size_of(off) for off, _ in ranges)


def test_full_pool_returns_none_and_free_makes_room() -> None:
    alloc = OffsetAllocator(64 * 10)
    offs = [alloc.allocate(64) for _ in range(10)]
    assert None not in offs
    assert alloc.allocate(1) is None
    alloc.free(offs[3])
    assert alloc.allocate(64) == offs[3]


def test_neighbours_coalesce_into_one_extent() -> None:
    alloc = OffsetAllocator(64 * 4)
    a, b, c, d = (alloc.allocate(64) for _ in range(4))
    for off in (a, c, b, d):  # b merges with both sides, d closes the pool
        alloc.free(off)
    stats = alloc.stats()
    assert stats.free_extents == 1 and stats.largest_free == 64 * 4 and stats.used == 0
    assert alloc.allocate(64 * 4) == 0


def test_best_fit_keeps_the_large_hole() -> None:
    alloc = OffsetAllocator(64 * 20)
    small_hole = alloc.allocate(64)
    sep1 = alloc.allocate(64)
    big_hole = alloc.allocate(64 * 8)
    alloc.allocate(64)  # separator so the big hole does not merge with the tail
    alloc.free(small_hole)
    alloc.free(big_hole)
    assert sep1 is not None
    assert alloc.allocate(64) == small_hole
    assert alloc.allocate(64 * 8) == big_hole


def test_bad_calls_raise() -> None:
    alloc = OffsetAllocator(4096)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(128)
    with pytest.raises(ValueError):
        OffsetAllocator(10)


def test_random_fill_free_refill_does_not_fragment() -> None:
    rng = random.Random(1234)
    capacity = 64 << 20
    alloc = OffsetAllocator(capacity)
    live: dict[int, int] = {}
    for round_ in range(5):
        # Fill until a request fails; a failure is only allowed when no extent is large enough.
        while True:
            size = rng.randint(1, 256 << 10)
            off = alloc.allocate(size)
            if off is None:
                assert alloc.largest_free() < size
                break
            live[off] = size
        assert alloc.stats().free < capacity * 0.05, f"round {round_}: pool not nearly full"
        for off in rng.sample(sorted(live), len(live) // 2):
            alloc.free(off)
            del live[off]
        stats = alloc.stats()
        assert stats.used == sum(alloc.size_of(o) for o in live)
        # Coalescing: never more free extents than there are gaps between live allocations.
        assert stats.free_extents <= len(live) + 1
    for off in list(live):
        alloc.free(off)
    stats = alloc.stats()
    assert stats.used == 0 and stats.free_extents == 1 and stats.largest_free == capacity


def test_many_small_objects_are_fast_enough() -> None:
    alloc = OffsetAllocator(100_000 * 4096)
    offs = [alloc.allocate(4096) for _ in range(100_000)]
    assert None not in offs
    for off in offs[::2]:
        alloc.free(off)  # type: ignore[arg-type]
    assert alloc.stats().free_extents == 50_000
