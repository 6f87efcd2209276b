"""Prefill instances report their local prefix caches; the conductor's view follows them."""

from __future__ import annotations

import httpx
import torch
from fastapi import FastAPI
from sched_helpers import cluster

from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.roles.conductor.scheduler.local_index import (
    LocalCacheIndex,
    local_cache_router,
)
from mooncake_server.roles.conductor.scheduler.oracle import STORE_WIDE, IndexPrefixOracle
from mooncake_server.roles.prefill.cache_report import CacheReporter
from mooncake_server.roles.prefill.prefix_cache import LocalPrefixCache
from mooncake_server.wire.jobs import PrefillCacheReport

SECRET = "s3cret"


def conductor(index: LocalCacheIndex) -> httpx.AsyncClient:
    app = FastAPI()
    app.include_router(local_cache_router(index, SECRET))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c")


def cache(blocks: int = 4) -> LocalPrefixCache:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=2, block_tokens=2, dtype=torch.float32)
    return LocalPrefixCache(PagedKVCache(layout, num_blocks=blocks))


def job(c: LocalPrefixCache, keys: list[str]) -> None:
    """What a prefill job does to the cache."""
    hit = c.match(keys)
    fresh = c.allocate(len(keys) - len(hit))
    c.insert(keys, hit + fresh)
    c.release(hit + fresh)


async def test_the_view_follows_jobs_and_evictions() -> None:
    index = LocalCacheIndex()
    local = cache(3)
    async with conductor(index) as http:
        reporter = CacheReporter("http://c", "p1", SECRET, local, http)
        assert await reporter.flush()  # the start-up snapshot (empty)
        job(local, ["a", "b"])
        assert await reporter.flush()
        assert index.prefix("p1", ["a", "b", "c"]) == 2
        job(local, ["x", "y"])  # 3 blocks: evicts "a"
        assert await reporter.flush()
        assert index.prefix("p1", ["a", "b"]) == 0
        assert index.prefix("p1", ["x", "y"]) == 2


async def test_a_conductor_that_lost_the_view_gets_a_snapshot() -> None:
    index = LocalCacheIndex()
    local = cache()
    async with conductor(index) as http:
        reporter = CacheReporter("http://c", "p1", SECRET, local, http)
        job(local, ["a", "b"])
        assert await reporter.flush()
        index.forget("p1")  # e.g. the conductor restarted
        job(local, ["c"])
        assert await reporter.flush()  # refused as a delta, then sent whole
        assert index.prefix("p1", ["a", "b"]) == 2 and index.prefix("p1", ["c"]) == 1


async def test_a_failed_report_is_not_lost() -> None:
    index = LocalCacheIndex()
    local = cache()
    async with conductor(index) as http:
        base = ["http://c"]
        reporter = CacheReporter(lambda: base[0], "p1", SECRET, local, http)
        assert await reporter.flush()
        job(local, ["a"])
        base[0] = "http://c/nowhere"  # the conductor answers 404 once
        assert not await reporter.flush()
        base[0] = "http://c"
        assert await reporter.flush()
        assert index.prefix("p1", ["a"]) == 1


def test_a_delta_from_an_unknown_epoch_or_out_of_order_asks_for_a_snapshot() -> None:
    index = LocalCacheIndex()
    snap = PrefillCacheReport(instance_id="p", epoch="e1", seq=1, snapshot=True, added=["a"])
    assert index.apply(snap).accepted
    skip = PrefillCacheReport(instance_id="p", epoch="e1", seq=3, added=["b"])
    assert index.apply(skip).resync
    other = PrefillCacheReport(instance_id="p", epoch="e2", seq=2, added=["b"])
    assert index.apply(other).resync
    assert index.prefix("p", ["a", "b"]) == 1


async def test_the_oracle_answers_each_prefill_instance_from_its_own_cache() -> None:
    class StoreIndex:
        async def prefix(self, keys: list[str]):
            from mooncake_server.wire.index import StorePrefixReply

            return StorePrefixReply(prefix=3, by_node={"s1": 3})

    index = LocalCacheIndex()
    index.apply(PrefillCacheReport(instance_id="p2", epoch="e", seq=1, snapshot=True,
                                   added=["k0", "k1"]))
    oracle = IndexPrefixOracle(StoreIndex(), cluster(2, 1), index)
    hits = await oracle.longest_prefix(["k0", "k1", "k2"])
    # The store (on its own host here, like every instance) is not a local cache of anyone.
    assert hits[STORE_WIDE] == 3 and hits["p2"] == 2 and "p1" not in hits
