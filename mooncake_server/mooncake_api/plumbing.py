"""What the blocking Mooncake API needs around its calls: the event-loop thread they run on,
caller values as (address, length) without copies, CRC32Cs of gathered pieces, and the folding
of per-key codes into one."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from mooncake_server.mooncake_api.surface import ErrorCode
from mooncake_server.transfer import crc32c_combine, crc32c_many

_T = TypeVar("_T")
Pieces = list[tuple[int, int]]


class LoopThread:
    """An event loop on a daemon thread; `run` blocks the caller until a coroutine is done."""

    def __init__(self) -> None:
        """Start the loop's thread."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mooncake-api",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` on the loop; block until it is done and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def address_of(value: Any) -> tuple[int, int, Any]:
    """(address, length, object to keep alive) of a bytes-like value, without copying it
    where Python allows (bytes, writable buffers); a read-only other buffer is copied once."""
    if isinstance(value, bytes):
        return ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value or 0, len(value), value
    view = memoryview(value).cast("B")
    if view.readonly:
        data = view.tobytes()
        return address_of(data)
    if len(view) == 0:
        return 0, 0, view
    return ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view), view


def checksum(pieces: Pieces) -> int:
    """CRC32C of an object made of `pieces`, in order."""
    crcs = crc32c_many([a for a, _ in pieces], [n for _, n in pieces])
    crc = crcs[0]
    for c, (_, n) in zip(crcs[1:], pieces[1:]):
        crc = crc32c_combine(crc, c, n)
    return crc


def first_error(codes: Sequence[int]) -> int:
    """0, or the first negative code."""
    return next((c for c in codes if c < 0), ErrorCode.OK)


def count_or_error(codes: list[int]) -> int:
    """How many were removed; a failure of the call itself (RPC) as its code."""
    if codes and all(c in (ErrorCode.RPC_FAIL, ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
                     for c in codes) and len(codes) == 1:
        return codes[0]
    return sum(1 for c in codes if c == 0)
