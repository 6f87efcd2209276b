"""A store node over its two tiers: leases under pressure, demotion, rehydration, index reports."""

from __future__ import annotations

import os
import random
from pathlib import Path

from store_procs import addr_of

from mooncake_server.roles.store.node import StoreNode
from mooncake_server.roles.store.ssd import SsdTier
from mooncake_server.transfer import crc32c
from mooncake_server.wire.index import StoreEntry

BLOCK = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_node(blocks: int, ssd: SsdTier | None = None) -> tuple[StoreNode, list[StoreEntry],
                                                                   Clock]:
    pool = memoryview(bytearray(blocks * BLOCK))
    reports: list[StoreEntry] = []
    clock = Clock()
    node = StoreNode(pool, addr_of(pool), ssd=ssd, demote_after_s=10.0, high_watermark=1.0,
                     report=reports.append, clock=clock)
    return node, reports, clock


def put(node: StoreNode, data: dict[str, bytes]) -> list[bool]:
    """What a writer does: reserve, copy the bytes in, commit. Per key: placed now."""
    keys = list(data)
    res = node.put_start(keys, [len(v) for v in data.values()])
    placed = [k for k, off in zip(keys, res.offsets) if off is not None]
    for key, off in zip(keys, res.offsets):
        if off is not None:
            node.pool[off:off + len(data[key])] = data[key]
    node.put_end(placed, [crc32c(data[k]) for k in placed])
    return [off is not None for off in res.offsets]


def read(node: StoreNode, objects: list) -> dict[str, bytes]:
    return {o.key: bytes(node.pool[o.offset:o.offset + o.size]) for o in objects}


async def test_leased_blocks_survive_memory_pressure_and_reads_never_cross() -> None:
    node, _, _ = make_node(16)
    rnd = random.Random(7)
    truth: dict[str, bytes] = {}
    first = {f"a{i}": os.urandom(BLOCK) for i in range(16)}
    truth.update(first)
    assert all(put(node, first))
    # Readers pin 6 blocks and keep them while writers push 5x the pool through it.
    held = await node.get([f"a{i}" for i in range(6)])
    assert held.lease_id is not None and len(held.objects) == 6
    pinned = read(node, held.objects)
    refused = 0
    for round_ in range(10):
        batch = {f"b{round_}-{i}": os.urandom(BLOCK) for i in range(8)}
        truth.update(batch)
        placed = put(node, batch)
        refused += placed.count(False)
        # A reader of random present keys gets exactly each key's own bytes.
        probe = rnd.sample(sorted(truth), 12)
        res = await node.get(probe, sparse=True)
        for key, data in read(node, res.objects).items():
            assert data == truth[key], f"{key} returned another block's bytes"
        if res.lease_id:
            node.release(res.lease_id)
    assert read(node, held.objects) == pinned == {k: truth[k] for k in pinned}
    assert all(node.table.is_ready(f"a{i}") for i in range(6))  # never evicted while leased
    assert node.stats().evictions >= 40
    # Full of leased data: a put is refused clearly instead of evicting what readers hold.
    more = await node.get([k for k in truth if node.table.is_ready(k) and k not in pinned])
    assert more.lease_id is not None
    res = node.put_start(["late"], [BLOCK])
    assert res.offsets == [None] and res.refused == ["late"]
    node.release(more.lease_id)
    node.release(held.lease_id)
    assert put(node, {"late": os.urandom(BLOCK)}) == [True]
    assert refused == 0  # while only 6 of 16 were pinned, eviction always made room


async def test_eviction_and_idleness_demote_to_ssd_and_get_rehydrates(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, 1 << 20)
    await ssd.open()
    node, reports, clock = make_node(4, ssd)
    blobs = {f"k{i}": os.urandom(BLOCK) for i in range(8)}
    for i in range(0, 8, 2):
        put(node, dict(list(blobs.items())[i:i + 2]))
    s = node.stats()
    assert s.dram_objects == 4 and s.ssd_objects == 4 and s.demotions == 4  # LRU -> SSD
    assert node.tier_of("k0") == "ssd" and node.tier_of("k7") == "dram"
    assert node.exists(list(blobs)) == ([True] * 8, 8)
    got = await node.get(["k0", "k1"])  # rehydrated (evicting two DRAM ones to SSD)
    assert [o.key for o in got.objects] == ["k0", "k1"]
    assert read(node, got.objects) == {"k0": blobs["k0"], "k1": blobs["k1"]}
    node.release(got.lease_id or "")
    s = node.stats()
    assert (s.rehydrations, s.hits_ssd, s.hits_dram) == (2, 2, 0)
    assert StoreEntry(key="k0", size=BLOCK, tier="dram") in reports
    # Untouched for demote_after_s: moved to SSD, DRAM freed.
    clock.now += 11
    assert await node.demote_idle() == 4
    assert node.stats().dram_objects == 0 and node.tier_of("k1") == "ssd"
    got = await node.get(list(blobs)[:4])
    assert read(node, got.objects) == {k: blobs[k] for k in list(blobs)[:4]}
    node.release(got.lease_id or "")
    await ssd.close()


async def test_corrupt_ssd_copy_is_a_miss_not_wrong_bytes(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, 1 << 20)
    await ssd.open()
    node, _, _ = make_node(1, ssd)
    put(node, {"x": os.urandom(BLOCK)})
    put(node, {"y": os.urandom(BLOCK)})  # x -> SSD
    await ssd.close()
    path = ssd.entry("x").path  # type: ignore[union-attr]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    got = await node.get(["x"])
    assert got.objects == [] and not node.exists(["x"])[0][0]
    assert node.stats().misses == 1
