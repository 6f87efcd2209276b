"""Consistent hashing over store nodes: K distinct replicas, stable, balanced, minimal movement."""

from __future__ import annotations

import pytest

from mooncake_server.roles.master.placement import HashRing

KEYS = [f"{i:032x}" for i in range(10_000)]


def test_targets_are_k_distinct_nodes_and_deterministic() -> None:
    ring = HashRing(["a", "b", "c"])
    for key in KEYS[:500]:
        t = ring.targets(key, 2)
        assert len(t) == 2 and len(set(t)) == 2
        assert HashRing(["c", "a", "b"]).targets(key, 2) == t  # order of nodes is irrelevant
    assert len(ring.targets("k", 5)) == 3  # never more than the nodes there are
    assert HashRing([]).targets("k", 2) == []
    with pytest.raises(ValueError, match="at least 1"):
        ring.targets("k", 0)


def test_keys_spread_evenly() -> None:
    ring = HashRing([f"node-{i}" for i in range(4)])
    counts: dict[str, int] = {}
    for key in KEYS:
        primary = ring.targets(key, 1)[0]
        counts[primary] = counts.get(primary, 0) + 1
    assert all(0.15 < c / len(KEYS) < 0.35 for c in counts.values()), counts


def test_losing_a_node_moves_only_its_keys() -> None:
    before = HashRing(["a", "b", "c", "d"])
    after = HashRing(["a", "b", "d"])
    moved = 0
    for key in KEYS:
        old, new = before.targets(key, 2), after.targets(key, 2)
        if "c" not in old:
            assert new == old  # untouched by c leaving
        else:
            moved += 1
            assert next(n for n in old if n != "c") in new  # the surviving copy stays a replica
    assert moved < 0.7 * len(KEYS)
