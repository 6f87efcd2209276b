"""The client's memory as the transfer engine needs it: every byte a transfer touches locally
lies in memory registered with the engine (as in Mooncake).

`Regions` are the caller's buffers (`register_buffer`): zero-copy calls read and write only
inside them. `Staging` is the `local_buffer_size` buffer the copying calls (`put(bytes)`,
`put(bytes)`) go through, one extent per call (a value larger than what is free is refused,
as Mooncake refuses it); `get` reads into a new buffer of the object's size, registered for
that call only. `staged_bytes` counts every byte copied through either,
so a zero-copy path can be shown to copy nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from collections.abc import Iterator

from mooncake_server.mooncake_api.surface import BufferHandle
from mooncake_server.roles.store.allocator import OffsetAllocator
from mooncake_server.transfer import TransferEngine, TransferError

_names = itertools.count()


def _view(addr: int, size: int) -> ctypes.Array[ctypes.c_char]:
    """The memory at [addr, addr + size) as a writable buffer object (no copy)."""
    return (ctypes.c_char * size).from_address(addr)


class Regions:
    """The caller's registered buffers."""

    def __init__(self, engine: TransferEngine) -> None:
        """Register with `engine`."""
        self._engine = engine
        self._names: dict[int, tuple[str, int]] = {}  # address -> (engine name, length)
        self._lock = threading.Lock()

    def add(self, addr: int, size: int) -> bool:
        """Register [addr, addr + size); False if it overlaps a registered buffer."""
        with self._lock:
            if any(a < addr + size and addr < a + n for a, (_, n) in self._names.items()):
                return False
            name = f"mooncake-api-buffer-{next(_names)}"
            self._engine.register_memory(name, _view(addr, size))
            self._names[addr] = (name, size)
            return True

    def remove(self, addr: int) -> bool:
        """Unregister the buffer that starts at `addr` (waits for transfers on it)."""
        with self._lock:
            entry = self._names.pop(addr, None)
        if entry is None:
            return False
        self._engine.unregister_memory(entry[0])
        return True

    def inside(self, addr: int, size: int) -> bool:
        """[addr, addr + size) lies in one registered buffer."""
        return size >= 0 and any(a <= addr and addr + size <= a + n
                                 for a, (_, n) in list(self._names.items()))

    def clear(self) -> None:
        """Unregister everything."""
        for addr in list(self._names):
            self.remove(addr)


class Staging:
    """The local buffer the copying calls go through."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        """Register `size` bytes (none when 0: every copy gets its own buffer)."""
        self._engine = engine
        self._buffer = ctypes.create_string_buffer(size) if size >= 4096 else None
        self._alloc = OffsetAllocator(size) if self._buffer is not None else None
        self._base = ctypes.addressof(self._buffer) if self._buffer is not None else 0
        if self._buffer is not None:
            engine.register_memory("mooncake-api-staging", self._buffer)
        self._lock = threading.Lock()
        self.staged_bytes = 0

    @contextlib.contextmanager
    def extent(self, size: int) -> Iterator[int | None]:
        """A registered address with room for `size` bytes, for the length of the block; None
        when the staging buffer has no such room (Mooncake refuses such a value: -600)."""
        offset = None
        if self._alloc is not None and size > 0:
            with self._lock:
                offset = self._alloc.allocate(size)
        if offset is None:
            yield None
            return
        try:
            yield self._base + offset
        finally:
            with self._lock:
                assert self._alloc is not None
                self._alloc.free(offset)

    @contextlib.contextmanager
    def own(self, size: int) -> Iterator[tuple[int, BufferHandle]]:
        """A new buffer of `size` bytes, registered for the block; it outlives the block."""
        buffer = BufferHandle(max(1, size))
        name = f"mooncake-api-scratch-{next(_names)}"
        self._engine.register_memory(name, buffer)
        try:
            yield buffer.ptr(), buffer
        finally:
            try:
                self._engine.unregister_memory(name)
            except (TransferError, KeyError):
                pass  # the engine closed meanwhile

    def count(self, nbytes: int) -> None:
        """Count bytes copied through staging."""
        with self._lock:
            self.staged_bytes += nbytes
