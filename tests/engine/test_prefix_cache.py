"""The prefill-local prefix cache: hits by chained key, ref counts, LRU eviction, change log."""

from __future__ import annotations

import pytest
import torch

from mooncake_server.engine.kv_cache import KVLayout, OutOfBlocks, PagedKVCache
from mooncake_server.roles.prefill.prefix_cache import LocalPrefixCache


def make(blocks: int = 6) -> LocalPrefixCache:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=2, block_tokens=2, dtype=torch.float32)
    return LocalPrefixCache(PagedKVCache(layout, num_blocks=blocks))


def test_a_released_job_leaves_its_blocks_findable_by_key() -> None:
    cache = make()
    blocks = cache.allocate(3)
    cache.insert(["a", "b"], blocks[:2])  # the third is a partial tail: never cached
    cache.release(blocks)
    assert cache.num_cached == 2 and cache.kv.num_free == 4
    assert cache.match(["a", "b", "c"]) == blocks[:2]
    assert cache.match(["x", "a"]) == []  # only a leading run counts


def test_eviction_takes_the_least_recently_used_idle_block_and_never_one_in_use() -> None:
    cache = make(4)
    first = cache.allocate(2)
    cache.insert(["a", "b"], first)
    cache.release(first)
    second = cache.allocate(2)
    cache.insert(["c", "d"], second)
    cache.release(second)
    held = cache.match(["a"])  # in use by a job: not evictable; "b" is now the oldest idle
    got = cache.allocate(2)
    assert cache.match(["a"]) == held  # still there
    cache.release(held)
    assert cache.keys() == ["a", "d"]  # "b" and "c" (oldest idle) went
    assert set(got) == {first[1], second[0]}
    with pytest.raises(OutOfBlocks):
        cache.allocate(3)  # 0 free, 2 idle
    assert cache.num_cached == 2  # a failed allocate evicts nothing


def test_changes_are_reported_net() -> None:
    cache = make(2)
    b = cache.allocate(2)
    cache.insert(["a", "b"], b)
    cache.release(b)
    assert cache.take_changes() == (["a", "b"], [])
    assert cache.take_changes() == ([], [])
    c = cache.allocate(1)  # evicts "a"
    cache.insert(["c"], c)
    cache.release(c)
    added, removed = cache.take_changes()
    assert added == ["c"] and removed == ["a"]
    cache.restore_changes(added, removed)  # a report that failed is sent again
    assert cache.take_changes() == (["c"], ["a"])


def test_a_key_cached_twice_keeps_the_first_block() -> None:
    cache = make(4)
    one, two = cache.allocate(1), cache.allocate(1)
    cache.insert(["a"], one)
    cache.insert(["a"], two)
    cache.release(one + two)
    assert cache.match(["a"]) == one and cache.kv.num_free == 3
