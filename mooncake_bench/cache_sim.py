"""Trace-driven prefix-cache simulation: one global KV pool against per-instance local caches,
over capacity (the paper's Fig. 9/10 and Table 2), with no model, no network and no bytes.

It runs the store's own code, not a copy of its rules: each cache is a store node's
`ObjectTable` (its allocator, LRU eviction and high watermark, roles/store/objects.py), blocks are
named by `block_keys` (chained: a key names a whole prefix, as in the live store), and the global
pool's nodes report what they commit and evict to a `GlobalIndex`, which answers the longest
cached prefix as the conductor asks it, with keys placed over the master's `HashRing`.

A request reads the longest cached prefix of its blocks (each block of it a hit), then writes
the blocks it lacked. The global pool is `nodes` store nodes that every request reads from;
local caches are `nodes` caches of the same size, each request served by one of them: round
robin (`local`), or the one holding its longest prefix, ties to the least used
(`local-aware`, the paper's local cache-aware scheduler). A trace's `hash_ids` are its blocks
(512 tokens each in Mooncake's traces); each id is one "token" of a chain of keys, so two
requests share block i exactly when they share ids 0..i.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mooncake_server.block_keys import block_keys
from mooncake_server.roles.master.index import GlobalIndex
from mooncake_server.roles.master.placement import HashRing
from mooncake_server.roles.store.objects import ObjectTable, StoreObject
from mooncake_server.wire.index import TIER_DRAM, StoreEntry, StoreReport

BLOCK_BYTES = 4096  # any multiple of the allocator's alignment: capacity is counted in blocks
NAMESPACE = "cache-sim"
MODES = ("global", "local", "local-aware")


class _Clock:
    """Simulated time: one tick per request (LRU order is all eviction reads from it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimNode:
    """One store node's DRAM: the store's object table, reporting to `index` as a node does."""

    def __init__(self, node_id: str, capacity_blocks: int, clock: _Clock,
                 index: GlobalIndex | None = None, high_watermark: float = 0.95) -> None:
        self.node_id = node_id
        self.index = index
        self._pending: list[StoreEntry] = []
        self._seq = itertools.count(1)
        self.served = 0  # requests this node served (local caches)
        # NOTE: a lease outlives the simulated trace (one tick per request): each read is
        # released at once, as a reader does once its bytes landed.
        self.table = ObjectTable(capacity_blocks * BLOCK_BYTES, high_watermark=high_watermark,
                                 default_lease_s=1e9, write_timeout_s=1e9, clock=clock,
                                 on_evict=self._evicted)
        if index is not None:
            index.apply(StoreReport(node_id=node_id, epoch="sim", seq=0, snapshot=True))

    def _evicted(self, obj: StoreObject) -> None:
        self._pending.append(StoreEntry(key=obj.key, size=obj.size, tier=None))

    def read(self, keys: list[str]) -> int:
        """Leading keys held here, touched as a read touches them (LRU)."""
        got = self.table.get(keys)
        if got.lease_id is not None:
            self.table.release(got.lease_id)
        return len(got.objects)

    def write(self, keys: list[str]) -> None:
        """Store `keys` (those already held are only touched), as put_start + put_end."""
        if not keys:
            return
        start = self.table.put_start(keys, [BLOCK_BYTES] * len(keys))
        new = [k for k, off in zip(keys, start.offsets) if off is not None]
        committed = self.table.put_end(new, [0] * len(new))
        self._pending += [StoreEntry(key=k, size=BLOCK_BYTES, tier=TIER_DRAM)
                          for k, ok in zip(new, committed) if ok]
        self.report()

    def report(self) -> None:
        """Send what changed to the index (a delta, as the node's reporter does)."""
        if self.index is not None and self._pending:
            self.index.apply(StoreReport(node_id=self.node_id, epoch="sim",
                                         seq=next(self._seq), entries=self._pending))
        self._pending = []


@dataclass
class SimResult:
    """Hit figures of one cache set-up over one trace."""

    mode: str
    capacity_blocks: int  # in all, over every node
    nodes: int
    requests: int = 0
    blocks: int = 0  # blocks requested (each request's hash ids)
    hits: int = 0  # of those, read from the cache
    per_request: list[int] = field(default_factory=list)  # hits of each request, in order

    @property
    def hit_rate(self) -> float:
        """Hit blocks / requested blocks."""
        return self.hits / self.blocks if self.blocks else 0.0


def request_keys(hash_ids: Sequence[int]) -> list[str]:
    """The chained keys of a request's blocks (one per hash id)."""
    return block_keys(list(hash_ids), 1, NAMESPACE)


def simulate(requests: Iterable[Sequence[int]], capacity_blocks: int, *, mode: str = "global",
             nodes: int = 4, high_watermark: float = 0.95) -> SimResult:
    """Replay requests (each its hash ids) through a cache set-up of `capacity_blocks` in all."""
    return simulate_keys([request_keys(r) for r in requests], capacity_blocks, mode=mode,
                         nodes=nodes, high_watermark=high_watermark)


def simulate_keys(requests: Sequence[list[str]], capacity_blocks: int, *, mode: str = "global",
                  nodes: int = 4, high_watermark: float = 0.95) -> SimResult:
    """`simulate` over requests already turned into keys (`request_keys`): hashed once for
    every capacity and mode a sweep runs."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if nodes < 1 or capacity_blocks < nodes:
        raise ValueError("need at least one node and one block per node")
    clock = _Clock()
    share = capacity_blocks // nodes
    result = SimResult(mode, share * nodes, nodes)
    index = GlobalIndex() if mode == "global" else None
    sims = [SimNode(f"node{i}", share, clock, index, high_watermark) for i in range(nodes)]
    by_id = {s.node_id: s for s in sims}
    ring = HashRing(by_id)
    alive = set(by_id)
    turn = itertools.cycle(sims)
    for keys in requests:
        clock.now += 1.0
        if index is not None:
            hit = index.prefix(keys, alive)
            for node, group in _by_node(keys[:hit], index, alive).items():
                by_id[node].read(group)
            for node, group in _by_target(keys[hit:], ring).items():
                by_id[node].write(group)
        else:
            node = next(turn) if mode == "local" else _aware_pick(sims, keys)
            node.served += 1
            hit = node.read(keys)
            node.write(keys[hit:])
        result.requests += 1
        result.blocks += len(keys)
        result.hits += hit
        result.per_request.append(hit)
    return result


def _by_node(keys: list[str], index: GlobalIndex, alive: set[str]) -> dict[str, list[str]]:
    """Cached keys grouped by the node a reader takes each from (its first live replica)."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        node = index.replicas(key, alive)[0][0]
        groups.setdefault(node, []).append(key)
    return groups


def _by_target(keys: list[str], ring: HashRing) -> dict[str, list[str]]:
    """New keys grouped by the node placement puts each on (one replica)."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(ring.targets(key, 1)[0], []).append(key)
    return groups


def _aware_pick(sims: list[SimNode], keys: list[str]) -> SimNode:
    """The local cache holding the longest prefix of `keys` (ties: the least used)."""
    def held(node: SimNode) -> int:
        n = 0
        for key in keys:
            if not node.table.is_ready(key):
                break
            n += 1
        return n

    return max(sims, key=lambda s: (held(s), -s.served))


def reused_share(requests: Iterable[Sequence[int]]) -> float:
    """Share of distinct blocks that more than one request asks for: how much of a trace any
    cache could ever reuse (the paper's Table 2 reads it beside the hit rates)."""
    return reused_share_of_keys([request_keys(r) for r in requests])


def reused_share_of_keys(requests: Iterable[list[str]]) -> float:
    """`reused_share` over requests already turned into keys."""
    counts = Counter(key for keys in requests for key in keys)
    return sum(1 for c in counts.values() if c > 1) / len(counts) if counts else 0.0
