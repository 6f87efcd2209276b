"""Offset allocator for a store node's memory pool: best-fit over a free list, coalescing neighbours.

The allocator never touches memory; it hands out offsets into [0, capacity) of a pool owned by
someone else (the registered shared-memory segment). Every offset and size is a multiple of
`ALIGNMENT` so that a block always starts on a cache line.

Free extents are indexed three ways (all kept in step):
  - `_free_by_size`: sorted list of (size, offset) -> best fit by one bisect (ties: lowest offset),
  - `_free_start`:   offset -> size               -> find the right-hand neighbour on free,
  - `_free_end`:     end offset -> offset         -> find the left-hand neighbour on free.
Because every freed range merges with free neighbours at once, two free extents are never adjacent,
so freeing everything always gives back the single extent [0, capacity).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

ALIGNMENT = 64


def align_up(size: int, alignment: int = ALIGNMENT) -> int:
    """Round a byte count up to a multiple of `alignment`."""
    return (size + alignment - 1) // alignment * alignment


class AllocatorStats(NamedTuple):
    """A snapshot of the allocator's occupancy."""

    capacity: int
    used: int
    free: int
    largest_free: int
    free_extents: int
    allocations: int


class OffsetAllocator:
    """Best-fit allocator of aligned byte ranges in [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        """Manage `capacity` bytes (rounded down to the alignment)."""
        if capacity < ALIGNMENT:
            raise ValueError(f"allocator capacity must be at least {ALIGNMENT} bytes, got {capacity}")
        self._capacity = capacity // ALIGNMENT * ALIGNMENT
        self._used = 0
        self._allocated: dict[int, int] = {}  # offset -> aligned size
        self._free_by_size: list[tuple[int, int]] = []
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._add_free(0, self._capacity)

    @property
    def capacity(self) -> int:
        """Usable bytes (a multiple of the alignment)."""
        return self._capacity

    @property
    def used(self) -> int:
        """Bytes currently handed out (aligned sizes)."""
        return self._used

    def allocate(self, size: int) -> int | None:
        """Reserve `size` bytes; return the offset, or None when no free extent is large enough."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = align_up(size)
        i = bisect.bisect_left(self._free_by_size, (need, -1))
        if i == len(self._free_by_size):
            return None
        extent_size, offset = self._free_by_size[i]
        self._remove_free(offset, extent_size)
        if extent_size > need:
            self._add_free(offset + need, extent_size - need)
        self._allocated[offset] = need
        self._used += need
        return offset

    def free(self, offset: int) -> int:
        """Give back the allocation starting at `offset`; return its aligned size."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not an allocation of this allocator")
        self._used -= size
        start, end = offset, offset + size
        right = self._free_start.get(end)
        if right is not None:
            self._remove_free(end, right)
            end += right
        left = self._free_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        self._add_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int:
        """Aligned size of the allocation at `offset`."""
        try:
            return self._allocated[offset]
        except KeyError:
            raise KeyError(f"offset {offset} is not an allocation of this allocator") from None

    def largest_free(self) -> int:
        """Size of the largest free extent (the biggest allocation that can succeed now)."""
        return self._free_by_size[-1][0] if self._free_by_size else 0

    def stats(self) -> AllocatorStats:
        """Occupancy snapshot."""
        return AllocatorStats(
            capacity=self._capacity,
            used=self._used,
            free=self._capacity - self._used,
            largest_free=self.largest_free(),
            free_extents=len(self._free_by_size),
            allocations=len(self._allocated),
        )

    def _add_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_by_size, (size, offset))
        self._free_start[offset] = size
        self._free_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free_by_size, (size, offset))
        # NOTE: the three indexes must agree; a mismatch is a bug in this module, not bad input.
        if i == len(self._free_by_size) or self._free_by_size[i] != (size, offset):
            raise RuntimeError(f"allocator free list corrupt at offset {offset} size {size}")
        del self._free_by_size[i]
        del self._free_start[offset]
        del self._free_end[offset + size]
