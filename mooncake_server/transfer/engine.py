"""Thin asyncio wrapper over the native transfer engine (`mooncake_server.transfer._native`).

A batch walks: allocate_batch -> submit_transfer (requests queue on native worker threads,
which slice them and move bytes over shm, RDMA or TCP; a failed slice is retried on another
connection, RDMA on TCP) -> every request DONE or FAILED -> wait()
returns or raises TransferError -> free_batch. Completion reaches asyncio through an eventfd
the native side bumps, watched with loop.add_reader, so waiting never blocks the event loop.

Objects by key: a serving engine publishes an object (key -> bytes in one of its segments and
the CRC32C they were stored with); a peer GETs it in one round trip (`get_published`), receiving
straight into its registered memory, with the CRC of what landed computed as it arrives. While a
GET sends an object it is pinned: `retire` says whether its bytes may be reused at once, else
their tag comes back from `take_drained` once the last GET is done.

Fused checksums (submit_transfer(..., checksums=True) / transfer(..., checksums=True)): the
worker that lands a READ slice computes its CRC32C right then, while the bytes are in cache (shm:
per 32 KiB piece just copied; TCP: per 64 KiB just received; RDMA: after the completion), and the
last slice of a request combines the slices' CRCs in offset order. WRITEs get None.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar, overload

from mooncake_server.transfer.errors import TransferError
from mooncake_server.transfer.transports import MODES, TRANSPORT_NAMES, open_rdma

if TYPE_CHECKING:
    from typing_extensions import Self

try:
    import mooncake_server.transfer._native as _native
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "mooncake_server.transfer._native is not built: run `pip install -e . --no-deps` in the "
        "repository root (needs a C compiler, Python headers and libssl-dev)"
    ) from exc

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Op(enum.IntEnum):
    """Direction of a request: READ remote -> local, WRITE local -> remote."""

    READ = 0
    WRITE = 1


_OP_GET = 2  # native request kind of a GET by key (get_published)


class PublishedObject(NamedTuple):
    """What a GET by key landed: the object's length, the CRC32C its owner published with it,
    and the CRC32C of the bytes as they arrived here."""

    length: int
    stored_crc: int
    landed_crc: int


class TransferState(enum.IntEnum):
    """Where one request of a batch stands."""

    PENDING = 0
    DONE = 1
    FAILED = 2


class TransferStatus(NamedTuple):
    """State of one request plus the failure reason (empty unless FAILED)."""

    state: TransferState
    message: str


@dataclass(frozen=True)
class TransferRequest:
    """Move `length` bytes between local memory and an opened remote segment."""

    op: Op
    local_addr: int  # absolute address inside a region registered in THIS engine
    segment: int  # handle returned by open_segment()
    remote_offset: int  # byte offset inside the remote segment
    length: int

    def __post_init__(self) -> None:
        if self.length < 0 or self.remote_offset < 0 or self.local_addr <= 0:
            raise ValueError(f"invalid transfer request {self!r}: negative offset/length or "
                             "null address")


def crc32c(buffer_or_addr: Any, length: int | None = None) -> int:
    """CRC32C of a buffer, or of `length` bytes at an address (SSE4.2 when present, GIL free)."""
    if length is None:
        if isinstance(buffer_or_addr, int):
            raise TypeError("crc32c(address) needs a length")
        return _native.crc32c(buffer_or_addr)
    if not isinstance(buffer_or_addr, int):
        raise TypeError("crc32c(x, length) needs x to be an integer address")
    if length < 0:
        raise ValueError(f"crc32c: negative length {length}")
    return _native.crc32c_addr(buffer_or_addr, length)


def crc32c_many(addrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """CRC32C of each (addrs[i], sizes[i]) range in one native call, GIL free for the batch."""
    # One call for the whole batch: a store get verifying 16 blocks hops threads once, not 16 times.
    return _native.crc32c_many(addrs, sizes)


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32C of A + B from crc32c(A), crc32c(B) and len(B), without touching the bytes."""
    if not (0 <= crc_a < 1 << 32 and 0 <= crc_b < 1 << 32):
        raise ValueError(f"crc32c_combine: CRCs must be 32-bit unsigned, got {crc_a}, {crc_b}")
    if not 0 <= length_b < 1 << 64:
        raise ValueError(f"crc32c_combine: length must be in 0..2**64-1, got {length_b}")
    return _native.crc32c_combine(crc_a, crc_b, length_b)


def _split_peer(peer: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer must be 'host:port', got {peer!r}")
    return host.strip("[]"), int(port)


def _native_call(peer: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Run a native call, turning its NativeError into TransferError naming the peer."""
    try:
        return fn(*args)
    except _native.NativeError as exc:
        raise TransferError(peer, str(exc)) from None


class TransferEngine:
    """Registered memory + batched READ/WRITE to peers' segments (Mooncake's batch API).

    `transport`: auto (shm > rdma > tcp, per peer), or one forced. `verify_crc`: every slice
    carries a CRC32C that the receiving side checks (a mismatch fails it with a clear error).
    `rdma_device` / `rdma_gid_index`: which NIC and GID (default: the first device, and a RoCE v2
    IPv4 GID when there is one).
    """

    def __init__(self, *, secret: bytes, listen_host: str = "127.0.0.1", listen_port: int = 0,
                 transport: str = "auto", slice_bytes: int = 512 << 10,
                 connections_per_peer: int = 4, timeout_s: float = 10.0,
                 serve: bool = True, verify_crc: bool = False, rdma_device: str | None = None,
                 rdma_gid_index: int = -1) -> None:
        if transport not in MODES:
            raise ValueError(f"transport must be one of auto, shm, tcp, rdma; got {transport!r}")
        if not 4096 <= slice_bytes <= _native.MAX_SLICE_BYTES:
            raise ValueError(f"slice_bytes must be in 4096..{_native.MAX_SLICE_BYTES}, "
                             f"got {slice_bytes}")
        if not 1 <= connections_per_peer <= 64:
            raise ValueError(f"connections_per_peer must be in 1..64, got {connections_per_peer}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"listen_port must be in 0..65535, got {listen_port}")
        if not secret:
            logger.warning("transfer engine started with an empty cluster secret: any local "
                           "process that also uses an empty secret can read and write segments")
        self._native = _native_call(
            f"{listen_host}:{listen_port}", _native.Engine,
            bytes(secret), listen_host, listen_port, slice_bytes, connections_per_peer,
            float(timeout_s), serve, _worker_count(connections_per_peer), verify_crc)
        try:
            self._rdma_device = open_rdma(self._native, transport, rdma_device, rdma_gid_index)
        except BaseException:
            self._native.close()
            raise
        self._host = listen_host
        self._serve = serve
        self._mode = MODES[transport]
        self.verify_crc = verify_crc
        self._peers: dict[int, str] = {}  # segment handle -> "host:port"
        self._batch_segments: dict[int, list[int]] = {}  # batch -> segment handle per request
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching notify_fd
        self._closed = False

    # -- identity and memory ---------------------------------------------------------------

    @property
    def rdma_device(self) -> str | None:
        """The RDMA device this engine opened, or None (no RDMA: shm and TCP only)."""
        return self._rdma_device

    @property
    def address(self) -> str:
        """'host:port' this engine serves on (port 0 at construction -> the ephemeral port)."""
        if not self._serve:
            raise TransferError("", "this engine was created with serve=False: no address")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._native.port}"

    def alloc_shared(self, name: str, nbytes: int) -> memoryview:
        """Zero-filled shared memory, registered as segment `name`; same-host peers map it."""
        return memoryview(_native_call("", self._native.alloc_shared, name, nbytes))

    def register_memory(self, name: str, buffer: Any) -> None:
        """Register a writable buffer as segment `name` (served over RDMA or TCP, not shm)."""
        _native_call("", self._native.register_memory, name, buffer)

    def unregister_memory(self, name: str) -> None:
        """Stop serving `name`; blocks until transfers touching it have finished."""
        _native_call("", self._native.unregister_memory, name)

    # -- segments --------------------------------------------------------------------------

    def open_segment(self, peer: str, name: str) -> int:
        """Handshake with `peer` and open its segment `name`; blocking, returns a handle."""
        host, port = _split_peer(peer)
        try:
            handle: int = self._native.open_segment(host, port, name, self._mode)
        except _native.NativeError as exc:
            raise TransferError(peer, f"cannot open segment {name!r}: {exc}") from None
        self._peers[handle] = peer
        _, transport, why = _native_call(peer, self._native.segment_info, handle)
        logger.debug("opened segment %r on %s over %s%s", name, peer, TRANSPORT_NAMES[transport],
                     f" ({why})" if why else "")
        return handle

    async def open_segment_async(self, peer: str, name: str) -> int:
        """open_segment without blocking the event loop (runs in the default executor)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(self.open_segment, peer, name))

    def segment_size(self, handle: int) -> int:
        """Size in bytes of an opened remote segment."""
        size, _, _ = _native_call("", self._native.segment_info, handle)
        return int(size)

    def transport_of(self, handle: int) -> str:
        """'shm', 'rdma' or 'tcp': how requests to this segment travel."""
        _, transport, _ = _native_call("", self._native.segment_info, handle)
        return TRANSPORT_NAMES[transport]

    def fallback_reason(self, handle: int) -> str:
        """Why `auto` settled for TCP on this segment ('' when it did not)."""
        _, _, why = _native_call("", self._native.segment_info, handle)
        return str(why)

    # -- batches ---------------------------------------------------------------------------

    def allocate_batch(self, n: int) -> int:
        """A batch id able to hold `n` requests."""
        batch: int = _native_call("", self._native.allocate_batch, n)
        self._batch_segments[batch] = []
        return batch

    def submit_transfer(self, batch: int, requests: Sequence[TransferRequest],
                        checksums: bool = False) -> None:
        """Queue requests on native workers; returns at once (all validated, or none queued).

        `checksums`: each READ's CRC32C is computed by the worker that lands its bytes, while
        they are in cache (see get_checksums); costs a fraction of a second pass over them.
        """
        items = [(int(r.op), r.local_addr, r.segment, r.remote_offset, r.length)
                 for r in requests]
        _native_call("", self._native.submit_transfer, batch, items, checksums)
        self._batch_segments.setdefault(batch, []).extend(r.segment for r in requests)

    def get_checksums(self, batch: int) -> list[int | None]:
        """Per request of a completed batch (submission order): the CRC32C of the bytes a READ
        submitted with checksums=True landed in local memory; None for WRITEs, for READs
        submitted without checksums and for failed requests."""
        return _native_call("", self._native.checksums, batch)

    def get_transfer_status(self, batch: int, i: int) -> TransferStatus:
        """State of request `i` (submission order) of `batch`."""
        state, message = _native_call("", self._native.status, batch, i)
        return TransferStatus(TransferState(state), message)

    def wait_sync(self, batch: int) -> None:
        """Block (GIL released) until `batch` completes; raise TransferError if any failed."""
        _native_call("", self._native.wait, batch)
        self._raise_if_failed(batch)

    async def wait(self, batch: int) -> None:
        """Await completion of `batch` without blocking the loop; raise if any request failed."""
        loop = asyncio.get_running_loop()
        if not self._watch(loop):
            # NOTE: notify_fd already belongs to another live loop; park a thread instead.
            await loop.run_in_executor(None, self._native.wait, batch)
        else:
            fut: asyncio.Future[None] = loop.create_future()
            waiters = self._waiters.setdefault(batch, [])
            waiters.append(fut)
            try:
                # registered before polling: a completion after this poll bumps notify_fd
                if _native_call("", self._native.poll, batch)[0]:
                    fut.set_result(None)
                await fut
            finally:
                waiters.remove(fut)
                if not waiters:
                    self._waiters.pop(batch, None)
        self._raise_if_failed(batch)

    def free_batch(self, batch: int) -> None:
        """Release a batch id; if requests are still running it is released when they end."""
        self._batch_segments.pop(batch, None)
        _native_call("", self._native.free_batch, batch)

    @overload
    async def transfer(self, requests: Sequence[TransferRequest],
                       checksums: Literal[False] = ...) -> None: ...

    @overload
    async def transfer(self, requests: Sequence[TransferRequest],
                       checksums: Literal[True]) -> list[int | None]: ...

    @overload
    async def transfer(self, requests: Sequence[TransferRequest],
                       checksums: bool) -> list[int | None] | None: ...

    async def transfer(self, requests: Sequence[TransferRequest],
                       checksums: bool = False) -> list[int | None] | None:
        """allocate_batch + submit_transfer + wait + free_batch.

        With `checksums`, returns get_checksums(): per request the CRC32C of the bytes a READ
        landed (computed as they landed), None for each WRITE.
        """
        if not requests:
            return [] if checksums else None
        batch = self.allocate_batch(len(requests))
        try:
            self.submit_transfer(batch, requests, checksums)
            await self.wait(batch)
            return self.get_checksums(batch) if checksums else None
        finally:
            self.free_batch(batch)

    # -- objects by key --------------------------------------------------------------------

    async def get_published(self, segment: int,
                            gets: Sequence[tuple[str, int, int]]) -> list[PublishedObject | None]:
        """GET each (key, local_addr, length) from the engine serving `segment`, in one batch.

        Per key: what landed at local_addr, or None when the key is not published there (a
        miss). Raises TransferError when a GET failed (peer down, an object of another length).
        """
        if not gets:
            return []
        batch = self.allocate_batch(len(gets))
        try:
            items = [(_OP_GET, addr, segment, 0, length, key) for key, addr, length in gets]
            _native_call("", self._native.submit_transfer, batch, items, True)
            self._batch_segments.setdefault(batch, []).extend(segment for _ in gets)
            await self.wait(batch)
            found = _native_call("", self._native.gets, batch)
            return [None if f is None else PublishedObject(*f) for f in found]
        finally:
            self.free_batch(batch)

    def publish(self, key: str, segment: str, offset: int, length: int, crc: int,
                tag: int) -> None:
        """Serve `length` bytes at `offset` of our segment `segment` to GETs of `key`."""
        _native_call("", self._native.publish, key, segment, offset, length, crc, tag)

    def retire(self, key: str, tag: int) -> bool:
        """Stop serving `key` (the object published with `tag`); True when its bytes may be
        reused now, False when a GET still sends them (`take_drained` returns `tag` later)."""
        return bool(_native_call("", self._native.retire, key, tag))

    def take_drained(self) -> list[int]:
        """Tags of retired objects whose last GET finished since the last call."""
        return _native_call("", self._native.take_drained)

    def take_touched(self) -> list[tuple[str, int]]:
        """(key, GETs served) for each key read by GET since the last call."""
        return _native_call("", self._native.take_touched)

    @property
    def published(self) -> int:
        """How many objects this engine serves by key."""
        return int(self._native.published)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Fail in-flight requests, stop native threads, drop connections and mappings."""
        if self._closed:
            return
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            fd = self._native.notify_fd
            if loop.is_running() and not _is_current(loop):
                loop.call_soon_threadsafe(loop.remove_reader, fd)
                loop.call_soon_threadsafe(self._wake_all)
            else:
                loop.remove_reader(fd)
                self._wake_all()
        self._native.close()

    def __enter__(self) -> Self:
        """Use as a context manager: closed on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the engine."""
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Make `loop` watch notify_fd unless another live loop already does."""
        if self._loop is loop:
            return True
        if self._loop is not None and not self._loop.is_closed():
            return False
        self._loop = loop
        loop.add_reader(self._native.notify_fd, self._on_notify)
        return True

    def _on_notify(self) -> None:
        """notify_fd fired: some batch completed; wake the waiters of finished batches."""
        self._native.drain_notify()
        for batch, futs in list(self._waiters.items()):
            try:
                done = self._native.poll(batch)[0]
            except (ValueError, _native.NativeError):
                done = True  # freed or closed: the waiter reports it when it re-polls
            if done:
                for fut in futs:
                    if not fut.done():
                        fut.set_result(None)

    def _wake_all(self) -> None:
        """Resolve every waiter (on close); each then sees the engine closed."""
        for futs in self._waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def _raise_if_failed(self, batch: int) -> None:
        """Raise TransferError for the first failed request of a completed batch."""
        _, failed, message = _native_call("", self._native.poll, batch)
        if failed >= 0:
            segments = self._batch_segments.get(batch, [])
            peer = self._peers.get(segments[failed], "") if failed < len(segments) else ""
            raise TransferError(peer, message)


def _worker_count(connections_per_peer: int) -> int:
    """Native worker threads: enough to keep every pooled connection of two peers busy."""
    return min(64, max(4, 2 * connections_per_peer))


def _is_current(loop: asyncio.AbstractEventLoop) -> bool:
    """True when called from inside `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
