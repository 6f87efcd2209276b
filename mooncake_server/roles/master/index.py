"""The store master's global index: which store node holds which key, in which tier, how big.

Pure bookkeeping, no I/O; the store master (`--role master`, or in the conductor) owns one
and feeds it the nodes' reports. A node's reports form one stream per epoch (one epoch per
node start): a snapshot replaces everything the index knew of that node, then deltas apply
in order. A report from an epoch the index does not know (master restarted, node restarted)
asks for a resync.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from mooncake_server.wire.index import TIER_DRAM, TIER_SSD, StoreEntry, StoreReport

_TIERS = (TIER_DRAM, TIER_SSD)


class IndexStats(NamedTuple):
    """Sizes of the index."""

    keys: int
    replicas: int
    by_tier: dict[str, int]
    by_node: dict[str, int]


class GlobalIndex:
    """key -> {node: tier} plus key sizes, fed by store nodes' snapshots and deltas."""

    def __init__(self) -> None:
        """An empty index."""
        self._where: dict[str, dict[str, str]] = {}
        self._sizes: dict[str, int] = {}
        self._node_keys: dict[str, set[str]] = {}
        self._streams: dict[str, tuple[str, int]] = {}  # node -> (epoch, last seq)

    def apply(self, report: StoreReport) -> bool:
        """Apply a snapshot or delta; False when the node must resync (unknown epoch / order)."""
        for entry in report.entries:
            if entry.tier is not None and entry.tier not in _TIERS:
                raise ValueError(f"unknown tier {entry.tier!r} for key {entry.key}")
        node = report.node_id
        if report.snapshot:
            self.drop_node(node)
            self._streams[node] = (report.epoch, report.seq)
        else:
            stream = self._streams.get(node)
            if stream is None or stream[0] != report.epoch or report.seq <= stream[1]:
                return False
            self._streams[node] = (report.epoch, report.seq)
        for entry in report.entries:
            self._set(node, entry)
        return True

    def drop_node(self, node: str) -> int:
        """Forget everything a node held (it left or restarts); return how many keys."""
        keys = self._node_keys.pop(node, set())
        self._streams.pop(node, None)
        for key in keys:
            where = self._where.get(key)
            if where is not None:
                where.pop(node, None)
                if not where:
                    del self._where[key]
                    self._sizes.pop(key, None)
        return len(keys)

    def note(self, node: str, key: str, size: int) -> None:
        """Index a DRAM copy a client just committed on `node` (its node's report follows;
        applying both is harmless)."""
        if node in self._streams:
            self._set(node, StoreEntry(key=key, size=size, tier=TIER_DRAM))

    def forget(self, key: str) -> list[str]:
        """Take `key` out of the index at once (a client removes it); return its holders."""
        where = self._where.pop(key, {})
        self._sizes.pop(key, None)
        for node in where:
            self._node_keys[node].discard(key)
        return sorted(where)

    def keys(self) -> list[str]:
        """Every indexed key."""
        return list(self._where)

    def nodes(self) -> list[str]:
        """Nodes the index has reports from."""
        return sorted(self._streams)

    def size_of(self, key: str) -> int | None:
        """Size of a key's object, if any node holds it."""
        return self._sizes.get(key)

    def replicas(self, key: str, alive: Collection[str]) -> list[tuple[str, str]]:
        """(node, tier) of each live copy of `key`, DRAM copies first, then by node id."""
        where = self._where.get(key)
        if not where:
            return []
        found = [(n, t) for n, t in where.items() if n in alive]
        found.sort(key=lambda nt: (nt[1] != TIER_DRAM, nt[0]))
        return found

    def prefix(self, keys: list[str], alive: Collection[str]) -> int:
        """Leading keys that have at least one live copy somewhere."""
        return self.prefixes(keys, alive)[0]

    def prefix_by_node(self, keys: list[str], alive: Collection[str]) -> dict[str, int]:
        """For each live node, how many leading keys it alone holds."""
        return self.prefixes(keys, alive)[1]

    def prefixes(self, keys: list[str], alive: Collection[str]) -> tuple[int, dict[str, int]]:
        """`prefix` and `prefix_by_node` in one walk over the keys (the scheduler's query)."""
        # NOTE: a node's run can only continue while it held every earlier key, so the set of
        # candidates shrinks as we walk; the walk stops when no node's run and no store-wide
        # run is left: O(len(prefix) * replicas).
        by_node = {n: 0 for n in alive}
        running = set(alive)
        anywhere: int | None = None  # store-wide prefix, once it ended
        for i, key in enumerate(keys):
            where = self._where.get(key, {})
            if anywhere is None and not any(n in alive for n in where):
                anywhere = i
            for n in [n for n in running if n not in where]:
                by_node[n] = i
                running.discard(n)
            if anywhere is not None and not running:
                return anywhere, by_node
        for n in running:
            by_node[n] = len(keys)
        return (len(keys) if anywhere is None else anywhere), by_node

    def stats(self) -> IndexStats:
        """Counts for /metrics."""
        by_tier = {t: 0 for t in _TIERS}
        for where in self._where.values():
            for tier in where.values():
                by_tier[tier] += 1
        return IndexStats(len(self._where), sum(by_tier.values()), by_tier,
                          {n: len(k) for n, k in self._node_keys.items()})

    def _set(self, node: str, entry: StoreEntry) -> None:
        key = entry.key
        if entry.tier is None:
            where = self._where.get(key)
            if where is not None and where.pop(node, None) is not None:
                self._node_keys[node].discard(key)
                if not where:
                    del self._where[key]
                    self._sizes.pop(key, None)
            return
        self._where.setdefault(key, {})[node] = entry.tier
        self._sizes[key] = entry.size
        self._node_keys.setdefault(node, set()).add(key)
