"""One store node's objects across its tiers (DRAM pool, optional SSD) and its index reports.

A key on this node is in one of: DRAM only, DRAM + SSD (rehydrated, or demoted and re-read), SSD
only, or absent. Transitions and who causes them:
  put_end -> DRAM            LRU eviction -> SSD (bytes copied out, written in the background)
  idle for demote_after_s -> SSD (written from the pinned pool bytes, then dropped from DRAM)
  get of an SSD-only key -> rehydrated into DRAM (space reserved, file read into the pool,
  CRC32C checked, committed, pinned)          SSD LRU eviction / remove -> gone
Every change of a key's tier goes to `report(entry)` (the global index's delta stream).
Methods run on the store role's event loop, which serialises them; only SSD I/O and large
checksums leave it (aiofiles' threads, asyncio.to_thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from mooncake_server.roles.store.objects import (
    GetResult,
    KeyedReads,
    ObjectTable,
    PutStartResult,
    StoreObject,
)
from mooncake_server.roles.store.ssd import SsdError, SsdTier
from mooncake_server.transfer import crc32c
from mooncake_server.wire.index import TIER_DRAM, TIER_SSD, StoreEntry

logger = logging.getLogger(__name__)

# Checksums of more than this many bytes are computed in a worker thread.
_INLINE_CRC_BYTES = 256 << 10


class NodeStats(NamedTuple):
    """Everything /metrics exports about a node."""

    dram_objects: int
    dram_bytes: int
    dram_capacity: int
    dram_largest_free: int
    writing: int
    ssd_objects: int
    ssd_bytes: int
    ssd_capacity: int
    ssd_pending_bytes: int
    hits_dram: int
    hits_ssd: int
    misses: int
    evictions: int
    ssd_evictions: int
    demotions: int
    demotions_dropped: int
    rehydrations: int
    active_leases: int
    puts_refused: int
    gets_by_key: int
    draining_bytes: int


class StoreNode:
    """The object API of one node: put_start/put_end/get/release/exists/remove over two tiers."""

    def __init__(self, pool: memoryview, pool_addr: int, *, ssd: SsdTier | None = None,
                 demote_after_s: float = 300.0, high_watermark: float = 0.95,
                 report: Callable[[StoreEntry], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 keyed: KeyedReads | None = None) -> None:
        """Serve objects out of `pool` (registered at `pool_addr`), spilling to `ssd`; `keyed`
        also serves the READY ones to reads by key (the transfer engine's GET)."""
        self.pool = pool
        self.pool_addr = pool_addr
        self.ssd = ssd
        self.demote_after_s = demote_after_s
        self._report = report
        self._clock = clock
        self.table = ObjectTable(len(pool), high_watermark=high_watermark, clock=clock,
                                 on_evict=self._evicted, keyed=keyed)
        if ssd is not None:
            ssd.on_drop = self.ssd_dropped
        self._rehydrating: dict[str, asyncio.Future[bool]] = {}
        self._hits_dram = 0
        self._hits_ssd = 0
        self._misses = 0
        self._demotions = 0
        self._demotions_dropped = 0
        self._rehydrations = 0

    # ---- writes -------------------------------------------------------------------------------

    def put_start(self, keys: list[str], sizes: list[int], writer: str | None = None,
                  pin_s: float = 0.0) -> PutStartResult:
        """Reserve DRAM for new keys (pinned by `pin_s`, see `EvictionOrder`); keys held in
        either tier are skipped (offset None)."""
        if len(keys) != len(sizes):
            raise ValueError(f"put_start: {len(keys)} keys but {len(sizes)} sizes")
        ssd = self.ssd
        if ssd is None:
            return self.table.put_start(keys, sizes, writer, pin_s)
        on_ssd = [ssd.contains(k) and self.table.lookup(k) is None for k in keys]
        fresh = [i for i, skip in enumerate(on_ssd) if not skip]
        res = self.table.put_start([keys[i] for i in fresh], [sizes[i] for i in fresh], writer,
                                   pin_s)
        offsets: list[int | None] = [None] * len(keys)
        for i, off in zip(fresh, res.offsets):
            offsets[i] = off
        return PutStartResult(offsets, res.refused)

    def put_end(self, keys: list[str], checksums: list[int]) -> list[bool]:
        """Commit written keys; per key whether it is now readable here."""
        committed = self.table.put_end(keys, checksums)
        for key, ok in zip(keys, committed):
            if ok:
                self._changed(key)
        return committed

    def put_abort(self, keys: list[str], writer: str | None = None) -> int:
        """Free the reservations of keys whose write failed (only `writer`'s, if given)."""
        return self.table.put_abort(keys, writer)

    def remove(self, keys: list[str]) -> int:
        """Remove keys from both tiers; return how many were known."""
        count = 0
        for key in keys:
            known = self.table.remove([key]) > 0
            if self.ssd is not None and self.ssd.remove(key):
                known = True
            if known:
                count += 1
                self._changed(key)
        return count

    # ---- reads --------------------------------------------------------------------------------

    def exists(self, keys: list[str]) -> tuple[list[bool], int]:
        """Per key whether either tier holds it, and how many leading keys are held."""
        flags, _ = self.table.exists(keys)
        if self.ssd is not None:
            flags = [f or self.ssd.contains(k) for f, k in zip(flags, keys)]
        prefix = flags.index(False) if False in flags else len(flags)
        return flags, prefix

    def get_now(self, keys: list[str], lease_s: float | None = None, *,
                sparse: bool = False) -> GetResult | None:
        """get() without waiting: None when some wanted key must first come back from SSD."""
        wanted, from_ssd = self._wanted(keys, sparse)
        if from_ssd:
            return None
        return self._lease(keys, wanted, [], lease_s, sparse)

    async def get(self, keys: list[str], lease_s: float | None = None, *,
                  sparse: bool = False) -> GetResult:
        """Pin the leading held keys (sparse: all held keys), rehydrating SSD-only ones first."""
        wanted, from_ssd = self._wanted(keys, sparse)
        temp_leases: list[str] = []
        if from_ssd:
            results = await asyncio.gather(*[self._rehydrate(k, temp_leases) for k in from_ssd])
            failed = {k for k, ok in zip(from_ssd, results) if not ok}
            if failed:
                if sparse:
                    wanted = [k for k in wanted if k not in failed]
                else:
                    wanted = wanted[:next(i for i, k in enumerate(wanted) if k in failed)]
        return self._lease(keys, wanted, from_ssd, lease_s, sparse, temp_leases)

    def _wanted(self, keys: list[str], sparse: bool) -> tuple[list[str], list[str]]:
        """The keys a get pins (leading run, or all held if sparse) and those only on SSD."""
        wanted: list[str] = []
        from_ssd: list[str] = []
        for key in keys:
            if self.table.is_ready(key):
                wanted.append(key)
            elif self.ssd is not None and self.ssd.contains(key):
                wanted.append(key)
                from_ssd.append(key)
            elif not sparse:
                break
        return wanted, from_ssd

    def _lease(self, keys: list[str], wanted: list[str], from_ssd: list[str],
               lease_s: float | None, sparse: bool,
               temp_leases: list[str] | None = None) -> GetResult:
        """Pin `wanted` under one lease and count hits by tier."""
        try:
            res = self.table.get(wanted, lease_s, sparse=sparse) if wanted else GetResult(None, [])
        finally:
            for lease_id in temp_leases or ():
                self.table.release(lease_id)
        ssd_hits = len(set(from_ssd) & {o.key for o in res.objects}) if from_ssd else 0
        self._hits_ssd += ssd_hits
        self._hits_dram += len(res.objects) - ssd_hits
        self._misses += len(keys) - len(res.objects)
        return res

    def release(self, lease_id: str) -> bool:
        """Unpin a get's objects."""
        return self.table.release(lease_id)

    # ---- tiers --------------------------------------------------------------------------------

    async def demote_idle(self, limit: int = 256) -> int:
        """Move objects untouched for demote_after_s from DRAM to SSD; return how many moved."""
        if self.ssd is None:
            return 0
        cutoff = self._clock() - self.demote_after_s
        moved = 0
        for obj in self.table.idle(cutoff, limit):
            if self.table.lookup(obj.key) is not obj or obj.leases or not obj.last_access <= cutoff:
                continue  # touched, removed or leased while we wrote the previous one
            if not self.ssd.contains(obj.key):
                # Pinned while its bytes are written from the pool, so they cannot be reused.
                lease = self.table.get([obj.key], lease_s=3600.0, touch=False)
                try:
                    view = self.pool[obj.offset:obj.offset + obj.size]
                    ok = await self.ssd.write(obj.key, view, obj.checksum or 0)
                finally:
                    if lease.lease_id is not None:
                        self.table.release(lease.lease_id)
                if not ok:
                    continue
                self._demotions += 1
            # Still idle? (a get during the write touched it: keep it in DRAM)
            if obj.last_access <= cutoff and self.table.evict_key(obj.key):
                moved += 1
        return moved

    async def _rehydrate(self, key: str, temp_leases: list[str]) -> bool:
        """Bring an SSD-only key back into DRAM, pinned under a lease added to `temp_leases`."""
        running = self._rehydrating.get(key)
        if running is not None:
            await asyncio.shield(running)
        elif not self.table.is_ready(key):
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._rehydrating[key] = fut
            try:
                fut.set_result(await self._read_back(key))
            except BaseException:
                fut.set_result(False)
                raise
            finally:
                del self._rehydrating[key]
        lease = self.table.get([key], lease_s=3600.0)
        if lease.lease_id is None:
            return False
        temp_leases.append(lease.lease_id)
        return True

    async def _read_back(self, key: str) -> bool:
        ssd = self.ssd
        entry = ssd.entry(key) if ssd is not None else None
        if ssd is None or entry is None:
            return False
        res = self.table.put_start([key], [entry.size])
        offset = res.offsets[0]
        if offset is None:
            return self.table.is_ready(key)  # refused (no room), or someone else wrote it
        try:
            await ssd.read_into(key, self.pool[offset:offset + entry.size])
            got = await self._crc(offset, entry.size)
        except SsdError as exc:
            logger.warning("rehydrating %s failed: %s", key, exc)
            self.table.put_abort([key])
            self._changed(key)
            return False
        except BaseException:
            self.table.put_abort([key])
            raise
        if got != entry.checksum:
            logger.error("SSD copy of %s is corrupt (crc %#010x, expected %#010x); dropped",
                         key, got, entry.checksum)
            self.table.put_abort([key])
            ssd.remove(key)
            self._changed(key)
            return False
        self.table.put_end([key], [entry.checksum])
        self._rehydrations += 1
        self._changed(key)
        return True

    async def _crc(self, offset: int, size: int) -> int:
        if size > _INLINE_CRC_BYTES:
            return await asyncio.to_thread(crc32c, self.pool_addr + offset, size)
        return crc32c(self.pool_addr + offset, size)

    def _evicted(self, obj: StoreObject) -> None:
        """The table is about to reuse an object's space: keep a copy on SSD if there is one."""
        ssd = self.ssd
        if ssd is not None and not ssd.contains(obj.key):
            data = bytes(self.pool[obj.offset:obj.offset + obj.size])
            if ssd.stage(obj.key, data, obj.checksum or 0):
                self._demotions += 1
            else:
                self._demotions_dropped += 1
        self._changed(obj.key, size=obj.size)

    def ssd_dropped(self, key: str) -> None:
        """The SSD tier lost a key (its LRU, a bad file): tell the index what is left."""
        self._changed(key)

    # ---- reports ------------------------------------------------------------------------------

    def tier_of(self, key: str) -> str | None:
        """Where this node holds `key` now (DRAM wins over SSD), or None."""
        if self.table.is_ready(key):
            return TIER_DRAM
        if self.ssd is not None and self.ssd.contains(key):
            return TIER_SSD
        return None

    def snapshot(self) -> list[StoreEntry]:
        """Every key this node holds, for a full report."""
        entries = {o.key: StoreEntry(key=o.key, size=o.size, tier=TIER_DRAM)
                   for o in self.table.ready_objects()}
        if self.ssd is not None:
            for e in self.ssd.entries():
                entries.setdefault(e.key, StoreEntry(key=e.key, size=e.size, tier=TIER_SSD))
        return list(entries.values())

    def _changed(self, key: str, size: int | None = None) -> None:
        if self._report is None:
            return
        tier = self.tier_of(key)
        if size is None:
            obj = self.table.lookup(key)
            entry = self.ssd.entry(key) if self.ssd is not None else None
            size = obj.size if obj is not None else entry.size if entry is not None else 0
        self._report(StoreEntry(key=key, size=size, tier=tier))

    def stats(self) -> NodeStats:
        """Counters and gauges of both tiers."""
        t = self.table.stats()
        s = self.ssd.stats() if self.ssd is not None else None
        return NodeStats(
            dram_objects=t.objects, dram_bytes=t.bytes_used, dram_capacity=t.capacity,
            dram_largest_free=t.largest_free, writing=t.writing,
            ssd_objects=s.objects if s else 0, ssd_bytes=s.bytes_used if s else 0,
            ssd_capacity=s.capacity if s else 0, ssd_pending_bytes=s.pending_bytes if s else 0,
            hits_dram=self._hits_dram + t.keyed_hits, hits_ssd=self._hits_ssd,
            misses=self._misses,
            evictions=t.evictions, ssd_evictions=s.evictions if s else 0,
            demotions=self._demotions, demotions_dropped=self._demotions_dropped,
            rehydrations=self._rehydrations, active_leases=t.active_leases,
            puts_refused=t.puts_refused, gets_by_key=t.keyed_hits,
            draining_bytes=t.draining_bytes)
