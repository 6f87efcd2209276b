"""The object table of one store node: key -> placement, state, checksum, leases, LRU order.

An object walks this lifecycle:
  put_start -> WRITING (space reserved; the writer fills it through the transfer engine)
            -> put_end  -> READY (visible to exists/get, evictable when unleased)
            -> put_abort / write timeout -> freed
  READY -> get (pinned under a lease, never evicted while pinned) -> release / lease expiry
        -> evicted (LRU, when space is needed or usage passes the high watermark; soft-pinned
           objects last and only for space, hard-pinned never: `EvictionOrder`), taken out by
           the owner (`evict_key`, e.g. to demote it to SSD) or removed.
`on_evict` sees every object leaving the pool unasked (LRU or `evict_key`) while its bytes are
still in place, so the owner can keep a copy (the SSD tier) before the space is reused.
A removed object that is still leased leaves the key space at once (a new put may reuse the key)
but keeps its bytes until its last lease ends, so an in-flight reader never sees them change.
With `keyed` (the transfer engine serving READY objects to GETs by key, one round trip, no
lease), every READY object is published and is retired before its bytes are freed; bytes a GET
is still sending stay allocated until the engine reports them drained, and the engine's reads
count as hits and LRU touches when the table next absorbs them (reap, stats).

All methods are synchronous and O(keys · log objects); the store role calls them from its event
loop, which is what serialises them (no locks needed).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol

from mooncake_server.roles.store.allocator import OffsetAllocator, align_up
from mooncake_server.roles.store.eviction import EvictionOrder

logger = logging.getLogger(__name__)


class ObjectState(Enum):
    """Whether an object's bytes may be read yet."""

    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True, eq=False)
class StoreObject:
    """One stored block: where its bytes are and who may touch them."""

    key: str
    offset: int
    size: int  # bytes the writer declared (the reservation is this, aligned up)
    state: ObjectState
    checksum: int | None = None
    leases: int = 0
    last_access: float = 0.0
    removed: bool = False  # removed while busy: freed when the last lease / write ends
    tag: int = -1  # its publication for reads by key (unique per object, unlike the offset)
    writer: str | None = None  # the put_start's writer token (WRITING only matters)
    pin_s: float = 0.0  # Mooncake's pins: 0 none, a soft pin's TTL, or eviction.HARD_PIN
    pinned_until: float = 0.0  # a soft pin's end (renewed by reads)


@dataclass(slots=True)
class Lease:
    """Objects pinned by one get, until release or expiry."""

    lease_id: str
    objects: list[StoreObject]
    expires_at: float


class PutStartResult(NamedTuple):
    """Per-key offsets to write to (None = skip) and the keys that could not be placed."""

    offsets: list[int | None]
    refused: list[str]


class GetResult(NamedTuple):
    """The leading READY objects of a get, pinned under `lease_id` (None when nothing was found)."""

    lease_id: str | None
    objects: list[StoreObject]


class KeyedReads(Protocol):
    """What serves READY objects to readers by key, outside the table (the engine's GET)."""

    def publish(self, key: str, tag: int, offset: int, size: int, checksum: int) -> None:
        """Serve the object at `offset` under `key` from now on; `tag` names this object."""

    def retire(self, key: str, tag: int) -> bool:
        """Stop serving it; True when its bytes may be reused now, else its tag comes back
        from take_drained() once the reads in flight are done."""

    def take_drained(self) -> list[int]:
        """Tags of retired objects no read holds any more."""

    def take_touched(self) -> list[tuple[str, int]]:
        """(key, reads) served since the last call."""


class TableStats(NamedTuple):
    """Counters and gauges exported as metrics."""

    objects: int
    writing: int
    bytes_used: int
    capacity: int
    largest_free: int
    hits: int
    misses: int
    evictions: int
    active_leases: int
    puts_refused: int
    keyed_hits: int  # reads served by key (also in hits)
    draining_bytes: int  # freed objects whose bytes a keyed read still sends


class ObjectTable:
    """Key -> object map over an `OffsetAllocator`, with LRU eviction and leases."""

    def __init__(
        self,
        capacity: int,
        *,
        high_watermark: float = 0.95,
        default_lease_s: float = 30.0,
        write_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[StoreObject], None] | None = None,
        keyed: KeyedReads | None = None,
    ) -> None:
        """Manage `capacity` bytes; `clock` is injectable so tests can move time."""
        if not 0.0 < high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark}")
        if default_lease_s <= 0 or write_timeout_s <= 0:
            raise ValueError("default_lease_s and write_timeout_s must be positive")
        self._alloc = OffsetAllocator(capacity)
        self._high_bytes = int(self._alloc.capacity * high_watermark)
        self._default_lease_s = default_lease_s
        self._write_timeout_s = write_timeout_s
        self._clock = clock
        self._on_evict = on_evict
        self._objects: dict[str, StoreObject] = {}
        # NOTE: exactly the READY, unleased, not-removed, not hard-pinned objects.
        self._order = EvictionOrder(clock)
        self._leases: dict[str, Lease] = {}
        self._lease_deadlines: list[tuple[float, str]] = []
        self._write_deadlines: list[tuple[float, int, StoreObject]] = []
        self._seq = itertools.count()
        self._writing = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._refused = 0
        self._keyed = keyed
        self._keyed_hits = 0
        self._draining: dict[int, StoreObject] = {}  # tag -> retired, still being sent
        # Writers that aborted, until their reservations would have timed out anyway: a
        # put_start of theirs arriving after the abort reserves nothing.
        self._aborted_writers: dict[str, float] = {}

    @property
    def capacity(self) -> int:
        """Usable bytes of the pool."""
        return self._alloc.capacity

    # ---- writes -----------------------------------------------------------------------------

    def put_start(self, keys: list[str], sizes: list[int], writer: str | None = None,
                  pin_s: float = 0.0) -> PutStartResult:
        """Reserve space for each new key (state WRITING); None for present or refused keys,
        and for every key of a `writer` that aborted already. `pin_s`: the new objects' pin
        (see `EvictionOrder`)."""
        if len(keys) != len(sizes):
            raise ValueError(f"put_start: {len(keys)} keys but {len(sizes)} sizes")
        if any(s <= 0 for s in sizes):
            raise ValueError("put_start: every size must be positive")
        self.reap()
        if writer is not None and writer in self._aborted_writers:
            logger.info("put_start of aborted writer %s arrived late: nothing reserved", writer)
            return PutStartResult([None] * len(keys), [])
        now = self._clock()
        offsets: list[int | None] = []
        refused: list[str] = []
        for key, size in zip(keys, sizes):
            existing = self._objects.get(key)
            if existing is not None:
                # READY: already present. WRITING: another writer is filling it; do not race it.
                if key in self._order:
                    self._order.touch(key)
                    existing.last_access = now
                offsets.append(None)
                continue
            offset = self._place(size)
            if offset is None:
                refused.append(key)
                offsets.append(None)
                continue
            obj = StoreObject(key, offset, size, ObjectState.WRITING, last_access=now,
                              writer=writer, pin_s=pin_s)
            self._objects[key] = obj
            self._writing += 1
            heapq.heappush(self._write_deadlines, (now + self._write_timeout_s, next(self._seq), obj))
            offsets.append(offset)
        self._evict_to_watermark()
        if refused:
            self._refused += len(refused)
            logger.warning("store full: refused %d of %d keys", len(refused), len(keys))
        return PutStartResult(offsets, refused)

    def put_end(self, keys: list[str], checksums: list[int]) -> list[bool]:
        """Commit WRITING objects to READY; per key whether it is now READY in the table."""
        if len(keys) != len(checksums):
            raise ValueError(f"put_end: {len(keys)} keys but {len(checksums)} checksums")
        now = self._clock()
        committed: list[bool] = []
        for key, checksum in zip(keys, checksums):
            obj = self._objects.get(key)
            if obj is None:
                committed.append(False)  # reaped after a write timeout, or never started
            elif obj.state is ObjectState.READY:
                committed.append(True)
            elif obj.removed:
                self._finish_write(obj)
                self._drop(obj)
                committed.append(False)
            else:
                self._finish_write(obj)
                obj.state = ObjectState.READY
                obj.checksum = checksum
                obj.last_access = now
                self._order.add(obj)
                self._publish(obj)
                committed.append(True)
        # Reservations count toward usage but only READY objects can go, so check again here.
        self._evict_to_watermark()
        return committed

    def put_abort(self, keys: list[str], writer: str | None = None) -> int:
        """Free the WRITING reservations of these keys (READY ones are left alone); count them.

        With `writer`, only that writer's, and its put_start is refused if it comes later.
        """
        if writer is not None:
            self._aborted_writers[writer] = self._clock() + self._write_timeout_s
        freed = 0
        for key in keys:
            obj = self._objects.get(key)
            if obj is not None and obj.state is ObjectState.WRITING and (
                    writer is None or obj.writer == writer):
                self._finish_write(obj)
                self._drop(obj)
                freed += 1
        return freed

    # ---- reads ------------------------------------------------------------------------------

    def get(self, keys: list[str], lease_s: float | None = None, *,
            sparse: bool = False, touch: bool = True) -> GetResult:
        """Pin the longest run of leading READY keys (sparse: every READY key) under a lease.

        `touch=False` pins for the owner's own use: no access time, hit or miss is recorded.
        """
        lease_s = self._default_lease_s if lease_s is None else lease_s
        if lease_s <= 0:
            raise ValueError(f"get: lease_s must be positive, got {lease_s}")
        self.reap()
        now = self._clock()
        found: list[StoreObject] = []
        for key in keys:
            obj = self._objects.get(key)
            if obj is None or obj.state is not ObjectState.READY:
                if sparse:
                    continue
                break
            found.append(obj)
        if touch:
            self._hits += len(found)
            self._misses += len(keys) - len(found)
        if not found:
            return GetResult(None, [])
        for obj in found:
            if obj.leases == 0:
                self._order.discard(obj)
            obj.leases += 1
            if touch:
                obj.last_access = now
        lease = Lease(uuid.uuid4().hex, found, now + lease_s)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._lease_deadlines, (lease.expires_at, lease.lease_id))
        return GetResult(lease.lease_id, found)

    def release(self, lease_id: str) -> bool:
        """Unpin a lease's objects; False when it is unknown (already released or expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for obj in lease.objects:
            obj.leases -= 1
            if obj.leases == 0:
                if obj.removed:
                    self._drop(obj)
                else:
                    self._order.add(obj)  # re-enters as most recently used
        return True

    def exists(self, keys: list[str]) -> tuple[list[bool], int]:
        """Per key whether it is READY, and how many leading keys are."""
        objects = self._objects
        ready = ObjectState.READY
        flags = [(o := objects.get(k)) is not None and o.state is ready for k in keys]
        prefix = flags.index(False) if False in flags else len(flags)
        return flags, prefix

    def lookup(self, key: str) -> StoreObject | None:
        """The object stored under `key`, if any (any state)."""
        return self._objects.get(key)

    def is_writing(self, key: str) -> bool:
        """True while `key` is reserved and not yet committed."""
        obj = self._objects.get(key)
        return obj is not None and obj.state is ObjectState.WRITING

    def is_ready(self, key: str) -> bool:
        """True when `key` is READY (readable) in this pool."""
        obj = self._objects.get(key)
        return obj is not None and obj.state is ObjectState.READY

    def ready_objects(self) -> list[StoreObject]:
        """Every READY object (leased or not), for a full report to the global index."""
        return [o for o in self._objects.values() if o.state is ObjectState.READY]

    def idle(self, older_than: float, limit: int = 1024) -> list[StoreObject]:
        """Unleased READY objects not touched since `older_than` (clock time), oldest first."""
        self.absorb_keyed_reads()
        found: list[StoreObject] = []
        for obj in self._order.unpinned():  # LRU order: stop at the first recent one
            if obj.last_access > older_than or len(found) >= limit:
                break
            found.append(obj)
        return found

    def evict_key(self, key: str) -> bool:
        """Take one unleased READY object out of the pool now (on_evict sees it); False if busy."""
        obj = self._order.unpinned_object(key)
        if obj is None:
            return False
        self._evict(obj, counted=False)
        return True

    # ---- removal and housekeeping -----------------------------------------------------------

    def remove(self, keys: list[str]) -> int:
        """Remove keys now, or when their last lease / write ends; return how many were known."""
        count = 0
        for key in keys:
            obj = self._objects.get(key)
            if obj is None or obj.removed:
                continue
            count += 1
            obj.removed = True
            if obj.state is ObjectState.WRITING:
                continue  # put_end / put_abort / the write timeout frees it
            del self._objects[key]
            if obj.leases == 0:
                self._order.discard(obj)
                self._free(obj)
            elif self._keyed is not None:
                # Out of the key space now; its last lease frees the bytes (_drop -> _free).
                self._keyed.retire(key, obj.tag)
        return count

    def absorb_keyed_reads(self) -> None:
        """Count the reads served by key as hits and LRU touches; free drained bytes."""
        if self._keyed is None:
            return
        now = self._clock()
        for key, reads in self._keyed.take_touched():
            self._keyed_hits += reads
            self._hits += reads
            obj = self._objects.get(key)
            if obj is not None and obj.state is ObjectState.READY and not obj.removed:
                obj.last_access = now
                self._order.touch(key)
        for tag in self._keyed.take_drained():
            obj = self._draining.pop(tag, None)
            if obj is not None:
                self._alloc.free(obj.offset)

    def reap(self) -> int:
        """Release expired leases and free timed-out WRITING reservations; return how many."""
        self.absorb_keyed_reads()
        now = self._clock()
        reaped = 0
        while self._lease_deadlines and self._lease_deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_deadlines)
            if self.release(lease_id):
                reaped += 1
                logger.info("lease %s expired before release", lease_id)
        while self._write_deadlines and self._write_deadlines[0][0] <= now:
            _, _, obj = heapq.heappop(self._write_deadlines)
            if obj.state is ObjectState.WRITING and self._objects.get(obj.key) is obj:
                logger.warning("write of %s timed out; freeing its reservation", obj.key)
                self._finish_write(obj)
                self._drop(obj)
                reaped += 1
        for writer in [w for w, until in self._aborted_writers.items() if until <= now]:
            del self._aborted_writers[writer]
        return reaped

    def stats(self) -> TableStats:
        """Counters and gauges for /metrics."""
        self.absorb_keyed_reads()
        return TableStats(
            objects=len(self._objects) - self._writing,
            writing=self._writing,
            bytes_used=self._alloc.used,
            capacity=self._alloc.capacity,
            largest_free=self._alloc.largest_free(),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            active_leases=len(self._leases),
            puts_refused=self._refused,
            keyed_hits=self._keyed_hits,
            draining_bytes=sum(align_up(o.size) for o in self._draining.values()),
        )

    # ---- internals --------------------------------------------------------------------------

    def _place(self, size: int) -> int | None:
        need = align_up(size)
        pinned = self._alloc.used - self._order.bytes
        if need > self._alloc.capacity - pinned:
            return None  # cannot fit even with every evictable object gone: evict nothing
        while True:
            offset = self._alloc.allocate(size)
            victim = None if offset is not None else self._order.next_victim(for_space=True)
            if victim is None:
                return offset
            self._evict(victim)

    def _evict_to_watermark(self) -> None:
        while self._alloc.used > self._high_bytes:
            victim = self._order.next_victim(for_space=False)
            if victim is None:
                return
            self._evict(victim)

    def _evict(self, obj: StoreObject, counted: bool = True) -> None:
        self._order.discard(obj)
        del self._objects[obj.key]
        if self._on_evict is not None:
            # NOTE: before free(): the callback may still read the object's bytes.
            self._on_evict(obj)
        self._free(obj)
        self._evictions += counted

    def _finish_write(self, obj: StoreObject) -> None:
        # The write deadline heap entry stays; reap() skips objects no longer WRITING.
        self._writing -= 1

    def _drop(self, obj: StoreObject) -> None:
        if self._objects.get(obj.key) is obj:
            del self._objects[obj.key]
        self._free(obj)

    def _publish(self, obj: StoreObject) -> None:
        if self._keyed is None or obj.checksum is None:
            return
        obj.tag = next(self._seq)
        try:
            self._keyed.publish(obj.key, obj.tag, obj.offset, obj.size, obj.checksum)
        except Exception as exc:  # noqa: BLE001 - such a key is still served under a lease
            logger.debug("not serving %s by key: %s", obj.key, exc)

    def _free(self, obj: StoreObject) -> None:
        # A keyed read may be sending these bytes: they are reused only once it is done.
        if self._keyed is not None and obj.tag >= 0 and not self._keyed.retire(obj.key, obj.tag):
            self._draining[obj.tag] = obj
            return
        self._alloc.free(obj.offset)
