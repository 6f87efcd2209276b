"""StoreClient: how prefill and decode put / get KV blocks in one store node.

Control messages go over the node's binary RPC channel (one persistent authenticated connection,
calls pipelined; HTTP only for a node that advertises no channel); the bytes move only through the
transfer engine, one-sided, between the caller's registered memory and the store's registered pool:
  put: put_start (reserve) -> one engine.transfer() of WRITEs -> put_end (commit), or put_abort
  get: get (lease) -> one engine.transfer() of READs, each checksummed by the engine as it lands
       -> compare with the stored CRC32C -> release (always; sent in the background, so the
       reader does not wait for it)
  get over TCP: one engine GET per key (the node's engine looks the key up and pins the bytes
       while it sends them: one round trip, no lease) -> compare the landed CRC32C with the one
       stored; keys it does not serve (on SSD only, or absent) take the lease path above
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import TypeVar

import httpx
from pydantic import BaseModel

from mooncake_server.transfer import (
    Op,
    TransferEngine,
    TransferError,
    TransferRequest,
    crc32c_combine,
)
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.instances import StoreLocation
from mooncake_server.wire.routes import STORE_ROUTES, CallError, InvalidReply, PeerRefused, call
from mooncake_server.wire.rpc import RpcClient, RpcError
from mooncake_server.wire.store_ops import (
    StoreExistsReply,
    StoreGet,
    StoreGetReply,
    StoreKeys,
    StoreOp,
    StorePutEnd,
    StorePutEndReply,
    StorePutStart,
    StorePutStartReply,
    StoreRelease,
    StoreReleaseReply,
    StoreRemoveReply,
)

logger = logging.getLogger(__name__)

_Reply = TypeVar("_Reply", bound=BaseModel)
Spans = Sequence[tuple[int, int]]  # one object's bytes as (local address, length) pieces
# Attempts (0.5 s apart, doubling to 5 s: ~60 s in all, the store's write timeout) to abort a
# put_start that got no answer.
ABANDON_TRIES = 15


class StoreError(RuntimeError):
    """A store operation failed: the store is unreachable, refused the call, or a transfer broke."""


class ChecksumError(StoreError):
    """A block read from the store does not match the checksum it was stored with."""

    def __init__(self, key: str, expected: int, actual: int) -> None:
        """Name the block whose bytes are corrupt."""
        super().__init__(f"checksum mismatch for block {key}: stored {expected:#010x}, "
                         f"read {actual:#010x}")
        self.key = key
        self.expected = expected
        self.actual = actual


class StoreClient:
    """Puts, gets, probes and removes blocks in one store node."""

    def __init__(self, location: StoreLocation, engine: TransferEngine, http: httpx.AsyncClient,
                 secret: str) -> None:
        """Talk to the store at `location`; `engine` and `http` are owned by the caller."""
        self._location = location
        self._engine = engine
        self._http = http
        self._headers = secret_headers(secret)
        self._base = location.url.rstrip("/")
        self._segment: int | None = None
        self._segment_lock = asyncio.Lock()
        self._by_key: bool | None = None  # GET by key (TCP segments): decided once opened
        self._releases: set[asyncio.Task[None]] = set()
        self._abandoned: set[asyncio.Task[None]] = set()  # aborts of unanswered put_starts
        self._rpc: RpcClient | None = None
        self._notified = False  # releases sent without an answer since the last settle()
        if location.control_address:
            self._rpc = RpcClient(location.control_address, secret.encode(), http.timeout.read)

    @property
    def location(self) -> StoreLocation:
        """The store node this client talks to."""
        return self._location

    async def prefix_hits(self, keys: list[str]) -> int:
        """How many leading keys are present in the store."""
        if not keys:
            return 0
        reply = await self._call(StoreOp.EXISTS, StoreKeys(keys=keys), StoreExistsReply)
        return reply.prefix

    async def put(self, keys: list[str], addrs: list[int], sizes: list[int],
                  checksums: list[int], parts: Sequence[Spans] | None = None,
                  pin_ms: int = 0) -> list[bool]:
        """Write blocks from local registered memory; per key whether it is now in the store.

        `parts`: per key, the (address, length) pieces its bytes are gathered from, in order
        (`addrs` is then unused); `pin_ms`: Mooncake's pin (StorePutStart). A key that was
        already present (or is being written by another writer) counts as stored; a key the
        store refused for lack of space does not.
        On a transfer failure the reservations are aborted and StoreError is raised.
        """
        if not len(keys) == len(addrs) == len(sizes) == len(checksums):
            raise ValueError("put: keys, addrs, sizes and checksums must have the same length")
        if not keys:
            return []
        start = await self._put_start(keys, sizes, pin_ms)
        if len(start.offsets) != len(keys):
            raise StoreError(f"put_start: store answered {len(start.offsets)} offsets for "
                             f"{len(keys)} keys")
        placed = [i for i, off in enumerate(start.offsets) if off is not None]
        offsets = [off for off in start.offsets if off is not None]
        refused = set(start.refused)
        stored = [key not in refused for key in keys]
        if not placed:
            return stored
        placed_keys = [keys[i] for i in placed]
        try:
            handle = await self._segment_handle()
            await self._engine.transfer([
                TransferRequest(Op.WRITE, addr, handle, at, n)
                for i, off in zip(placed, offsets)
                for addr, at, n in _spans(parts[i] if parts else [(addrs[i], sizes[i])], off)
            ])
        except BaseException as exc:
            await self._abort_quietly(placed_keys)
            if isinstance(exc, (TransferError, OSError)):
                raise StoreError(f"writing {len(placed)} blocks to store "
                                 f"{self._location.instance_id} failed: {exc}") from exc
            raise
        end = await self._call(StoreOp.PUT_END,
                               StorePutEnd(keys=placed_keys, checksums=[checksums[i] for i in placed]),
                               StorePutEndReply)
        for i, ok in zip(placed, end.committed):
            stored[i] = ok
        return stored

    # ---- the put steps on their own, for a writer that fills the space gradually
    # (prefill streams each layer of a block as soon as it is computed) -----------------------

    async def reserve(self, keys: list[str], sizes: list[int]) -> StorePutStartReply:
        """put_start: offsets to write each key at (None = skip: present, in progress, refused)."""
        reply = await self._put_start(keys, sizes)
        if len(reply.offsets) != len(keys):
            raise StoreError(f"put_start: store answered {len(reply.offsets)} offsets for "
                             f"{len(keys)} keys")
        return reply

    async def commit(self, keys: list[str], checksums: list[int]) -> list[bool]:
        """put_end: per key whether it is now READY."""
        if not keys:
            return []
        end = await self._call(StoreOp.PUT_END, StorePutEnd(keys=keys, checksums=checksums),
                               StorePutEndReply)
        return end.committed

    async def abort(self, keys: list[str]) -> None:
        """put_abort, never raising (the store also reaps stale reservations on a timeout)."""
        if keys:
            await self._abort_quietly(keys)

    async def segment(self) -> int:
        """The transfer-engine handle of the node's segment (opened once)."""
        return await self._segment_handle()

    async def get(self, keys: list[str], addrs: list[int], sizes: list[int]) -> int:
        """Read the leading present blocks into local registered memory; return how many.

        Every block read is checked against its stored CRC32C (ChecksumError names the first bad
        one). The lease is released whatever happens.
        """
        got = await self._read(keys, addrs, sizes, sparse=False)
        return got.index(False) if False in got else len(got)

    async def get_any(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[bool]:
        """Read every present block (not only the leading run); per key whether it arrived."""
        return await self._read(keys, addrs, sizes, sparse=True)

    async def get_parts(self, keys: list[str], parts: Sequence[Spans]) -> list[bool]:
        """Read every present block scattered over its (address, length) pieces, in order
        (leased: one-sided READs straight into them, checksummed as they land)."""
        return await self._read_leased(keys, [0] * len(keys), [sum(n for _, n in p)
                                                               for p in parts], True, parts)

    async def _read(self, keys: list[str], addrs: list[int], sizes: list[int],
                    sparse: bool) -> list[bool]:
        if not len(keys) == len(addrs) == len(sizes):
            raise ValueError("get: keys, addrs and sizes must have the same length")
        if not keys:
            return []
        if not await self._reads_by_key():
            return await self._read_leased(keys, addrs, sizes, sparse)
        got = await self._read_by_key(keys, addrs, sizes)
        if all(got):
            return got
        # What the engine does not serve may still be here (on SSD: the lease path brings it
        # back into DRAM), or was evicted between a probe and this read.
        if sparse:
            rest = [i for i, ok in enumerate(got) if not ok]
        else:
            rest = list(range(got.index(False), len(keys)))
        more = await self._read_leased([keys[i] for i in rest], [addrs[i] for i in rest],
                                       [sizes[i] for i in rest], sparse)
        for i, ok in zip(rest, more):
            got[i] = ok
        return got

    async def _reads_by_key(self) -> bool:
        # Over TCP a GET by key saves the lease round trip; shm copies and RDMA READs are
        # one-sided already, so they keep the lease path.
        if self._by_key is None:
            handle = await self._segment_handle()
            self._by_key = self._engine.transport_of(handle) == "tcp"
        return self._by_key

    async def _read_by_key(self, keys: list[str], addrs: list[int],
                           sizes: list[int]) -> list[bool]:
        handle = await self._segment_handle()
        try:
            found = await self._engine.get_published(handle, list(zip(keys, addrs, sizes)))
        except (TransferError, OSError) as exc:
            raise StoreError(f"reading {len(keys)} blocks from store "
                             f"{self._location.instance_id} failed: {exc}") from exc
        hits = [(key, obj) for key, obj in zip(keys, found) if obj is not None]
        _verify([k for k, _ in hits], [o.stored_crc for _, o in hits],
                [o.landed_crc for _, o in hits])
        return [obj is not None for obj in found]

    async def _read_leased(self, keys: list[str], addrs: list[int], sizes: list[int],
                           sparse: bool, parts: Sequence[Spans] | None = None) -> list[bool]:
        reply = await self._call(StoreOp.GET, StoreGet(keys=keys, sparse=sparse), StoreGetReply)
        if reply.found == 0 or reply.lease_id is None:
            return [False] * len(keys)
        try:
            if sparse:
                if len(reply.present) != len(keys) or sum(reply.present) != reply.found:
                    raise StoreError(f"store {self._location.instance_id} sent an inconsistent "
                                     "sparse get reply")
                idx = [i for i, p in enumerate(reply.present) if p]
            else:
                idx = list(range(reply.found))
            for j, i in enumerate(idx):
                if reply.sizes[j] != sizes[i]:
                    raise StoreError(f"block {keys[i]} is {reply.sizes[j]} bytes in the store, "
                                     f"expected {sizes[i]}")
            handle = await self._segment_handle()
            try:
                # The engine checksums each block as it lands (fused with the copy / recv, on
                # its worker threads): no second pass over the bytes, no thread hop here.
                spans = [_spans(parts[i] if parts else [(addrs[i], sizes[i])],
                                reply.offsets[j]) for j, i in enumerate(idx)]
                landed = await self._engine.transfer([
                    TransferRequest(Op.READ, addr, handle, at, n)
                    for key_spans in spans for addr, at, n in key_spans
                ], checksums=True)
            except (TransferError, OSError) as exc:
                raise StoreError(f"reading {len(idx)} blocks from store "
                                 f"{self._location.instance_id} failed: {exc}") from exc
            if parts:
                landed = _combined(landed, [[n for _, _, n in sp] for sp in spans])
            _verify([keys[i] for i in idx], reply.checksums[:len(idx)], landed)
            got = [False] * len(keys)
            for i in idx:
                got[i] = True
            return got
        finally:
            # NOTE: the bytes are in local memory now; the release need not delay the reader
            # (a lease that is never released expires on its own).
            self._release_later(reply.lease_id)

    async def remove(self, keys: list[str]) -> None:
        """Remove keys from the store (a key being read goes when its reader is done)."""
        if keys:
            await self._call(StoreOp.REMOVE, StoreKeys(keys=keys), StoreRemoveReply)

    async def _segment_handle(self) -> int:
        # Opened once and cached: the handshake is a round trip we do not want per call.
        if self._segment is None:
            async with self._segment_lock:
                if self._segment is None:
                    try:
                        self._segment = await self._engine.open_segment_async(
                            self._location.transfer_address, self._location.segment)
                    except (TransferError, OSError) as exc:
                        raise StoreError(
                            f"cannot open segment {self._location.segment!r} of store "
                            f"{self._location.instance_id} at {self._location.transfer_address}: "
                            f"{exc}") from exc
        return self._segment

    async def _call(self, op: StoreOp, body: BaseModel, reply_type: type[_Reply]) -> _Reply:
        payload = body.model_dump_json()
        if self._rpc is not None:
            try:
                reply = await self._rpc.call(op, payload.encode())
            except RpcError as exc:
                raise StoreError(f"store {self._location.instance_id} {op.name.lower()} "
                                 f"failed: {exc}") from exc
            return reply_type.model_validate_json(reply)
        try:
            return await call(self._http, self._base, STORE_ROUTES[op], body,
                              headers=self._headers)
        except PeerRefused as exc:
            raise StoreError(f"store {op.name.lower()} failed: HTTP {exc.status}: "
                             f"{exc.body}") from exc
        except InvalidReply:
            raise
        except CallError as exc:
            raise StoreError(f"store {self._location.instance_id} unreachable at {exc.url}: "
                             f"{exc.__cause__!r}") from exc

    async def aclose(self) -> None:
        """Wait for lease releases in flight, then close the control connection (aborts of
        unanswered put_starts stop: the store's write timeout frees what they would)."""
        for task in list(self._abandoned):
            task.cancel()
        await asyncio.gather(*self._abandoned, return_exceptions=True)
        await self.settle()
        if self._rpc is not None:
            await self._rpc.aclose()

    async def _put_start(self, keys: list[str], sizes: list[int],
                         pin_ms: int = 0) -> StorePutStartReply:
        """put_start under a fresh writer token; if no answer comes, that token is aborted in
        the background: the request may still reach the store (a link back up delivers it)
        and would hold its space, in state WRITING, until the store's write timeout."""
        writer = uuid.uuid4().hex
        try:
            return await self._call(StoreOp.PUT_START,
                                    StorePutStart(keys=keys, sizes=sizes, writer=writer,
                                                  pin_ms=pin_ms),
                                    StorePutStartReply)
        except StoreError:
            task = asyncio.create_task(self._abort_writer(keys, writer),
                                       name=f"abort put_start {writer}")
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)
            raise

    async def _abort_writer(self, keys: list[str], writer: str) -> None:
        # NOTE: until the store answers once; the abort also makes it refuse that put_start
        # if it arrives after, so retrying until then is enough.
        delay = 0.5
        for _ in range(ABANDON_TRIES):
            try:
                await self._call(StoreOp.PUT_ABORT, StoreKeys(keys=keys, writer=writer),
                                 StoreRemoveReply)
                return
            except StoreError as exc:
                logger.debug("aborting unanswered put_start %s: %s", writer, exc)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)
        logger.warning("store %s never answered the abort of put_start %s (%d keys): the store "
                       "frees them at its write timeout", self._location.instance_id, writer,
                       len(keys))

    async def _abort_quietly(self, keys: list[str]) -> None:
        # The store also frees stale reservations on a timeout, so a failed abort only delays.
        try:
            await self._call(StoreOp.PUT_ABORT, StoreKeys(keys=keys), StoreRemoveReply)
        except Exception as exc:  # noqa: BLE001 - never mask the error that made us abort
            logger.warning("put_abort of %d keys failed: %s", len(keys), exc)

    async def settle(self) -> None:
        """Wait until every lease this client released is released in the store (tests,
        shutdown)."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)
        if self._notified and self._rpc is not None:
            self._notified = False
            # The store runs a connection's frames in order, so once this answers, every
            # release sent before it has been applied.
            with contextlib.suppress(StoreError):
                await self._call(StoreOp.EXISTS, StoreKeys(keys=[]), StoreExistsReply)

    def _release_later(self, lease_id: str) -> None:
        # NOTE: on the RPC channel a release is one frame with no answer: the reader never
        # waits for it, and the store does not spend a reply on it.
        payload = StoreRelease(lease_id=lease_id).model_dump_json().encode()
        if self._rpc is not None and self._rpc.notify(StoreOp.RELEASE, payload):
            self._notified = True
            return
        task = asyncio.get_running_loop().create_task(self._release_quietly(lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_quietly(self, lease_id: str) -> None:
        # The lease also expires on its own; a failed release only pins blocks a while longer.
        try:
            await self._call(StoreOp.RELEASE, StoreRelease(lease_id=lease_id), StoreReleaseReply)
        except Exception as exc:  # noqa: BLE001 - never mask the caller's error
            logger.warning("releasing lease %s failed: %s", lease_id, exc)


def _spans(pieces: Spans, offset: int) -> list[tuple[int, int, int]]:
    """(local address, offset in the store's segment, length) of each piece of one object
    that starts at `offset`."""
    out, at = [], offset
    for addr, n in pieces:
        out.append((addr, at, n))
        at += n
    return out


def _combined(landed: Sequence[int | None], lengths: list[list[int]]) -> list[int | None]:
    """One CRC32C per object from the CRC32Cs of its pieces, in order."""
    out: list[int | None] = []
    pos = 0
    for lens in lengths:
        crc: int | None = None
        for n in lens:
            piece = landed[pos]
            pos += 1
            if piece is None:
                crc = None
                break
            crc = piece if crc is None else crc32c_combine(crc, piece, n)
        out.append(crc)
    return out


def _verify(keys: list[str], stored: list[int], landed: Sequence[int | None]) -> None:
    """Raise ChecksumError for the first block whose landed CRC32C (computed by the transfer
    engine as its bytes arrived) is not the one it was stored with."""
    for key, want, got in zip(keys, stored, landed):
        if got != want:
            raise ChecksumError(key, want, got if got is not None else 0)
