"""The global store index and the master around it: reports, resync, prefixes, placement, hot keys."""

from __future__ import annotations

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.master.index import GlobalIndex
from mooncake_server.roles.master.master import StoreMaster
from mooncake_server.wire.index import StoreEntry, StoreReport
from mooncake_server.wire.instances import Heartbeat, InstanceInfo


def entries(keys: list[str], tier: str | None = "dram") -> list[StoreEntry]:
    return [StoreEntry(key=k, size=100, tier=tier) for k in keys]


def report(node: str, seq: int, keys: list[str], tier: str | None = "dram", *,
           epoch: str = "e1", snapshot: bool = False) -> StoreReport:
    return StoreReport(node_id=node, epoch=epoch, seq=seq, snapshot=snapshot,
                       entries=entries(keys, tier))


def test_snapshot_then_deltas_then_restart() -> None:
    index = GlobalIndex()
    assert not index.apply(report("n1", 1, ["a"]))  # deltas before any snapshot: resync
    assert index.apply(report("n1", 1, ["a", "b"], snapshot=True))
    assert index.apply(report("n1", 2, ["c"]))
    assert index.apply(report("n1", 3, ["b"], tier="ssd"))
    assert index.apply(report("n1", 4, ["a"], tier=None))
    alive = {"n1"}
    assert index.replicas("a", alive) == []
    assert index.replicas("b", alive) == [("n1", "ssd")]
    assert index.size_of("c") == 100
    assert not index.apply(report("n1", 4, ["x"]))  # replayed / out of order
    assert not index.apply(report("n1", 9, ["x"], epoch="old"))  # a previous life of the node
    # A restarted node's snapshot replaces everything it had.
    assert index.apply(report("n1", 1, ["z"], epoch="e2", snapshot=True))
    assert index.replicas("b", alive) == [] and index.replicas("z", alive) == [("n1", "dram")]
    assert index.stats().keys == 1


def test_prefix_overall_and_per_node() -> None:
    index = GlobalIndex()
    index.apply(report("n1", 1, ["k0", "k1", "k2"], snapshot=True))
    index.apply(report("n2", 1, ["k0", "k3"], snapshot=True))
    keys = ["k0", "k1", "k2", "k3", "k4"]
    assert index.prefix(keys, {"n1", "n2"}) == 4  # k0-k2 on n1, k3 on n2
    assert index.prefix(keys, {"n2"}) == 1  # n1 dead: only k0 remains
    assert index.prefix_by_node(keys, {"n1", "n2", "n3"}) == {"n1": 3, "n2": 1, "n3": 0}
    # DRAM copies are offered before SSD copies.
    index.apply(report("n1", 2, ["k0"], tier="ssd"))
    assert index.replicas("k0", {"n1", "n2"}) == [("n2", "dram"), ("n1", "ssd")]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cluster(nodes: int, replicas: int, **kw: object) -> tuple[StoreMaster, InstanceRegistry,
                                                                Clock]:
    clock = Clock()
    registry = InstanceRegistry(1.0, clock=clock)
    for i in range(nodes):
        registry.register(InstanceInfo(instance_id=f"n{i}", role="store", url=f"http://n{i}",
                                       transfer_address=f"127.0.0.1:{9000 + i}", segment="seg"))
    return StoreMaster(registry, replicas, "secret", **kw), registry, clock  # type: ignore[arg-type]


def test_place_and_locate_follow_live_nodes() -> None:
    master, registry, clock = cluster(3, 2)
    keys = [f"key-{i}" for i in range(50)]
    place = master.place(keys)
    assert all(len(t) == 2 for t in place.targets) and set(place.nodes) == {"n0", "n1", "n2"}
    # Nothing reported yet: locate falls back to the ring targets (a reader behind a writer) ...
    assert [[r.node_id for r in x] for x in master.locate(keys).replicas] == place.targets
    # ... unless asked for indexed copies only.
    assert all(x == [] for x in master.locate(keys, fallback=False).replicas)
    for node in ("n0", "n1", "n2"):
        mine = [k for k, t in zip(keys, place.targets) if node in t]
        master.report(report(node, 1, mine, snapshot=True))
    assert master.prefix(keys).prefix == 50
    # n1 stops heartbeating: it is no longer offered, and every key still has a copy.
    clock.now += 0.5
    for node in ("n0", "n2"):
        registry.heartbeat(Heartbeat(instance_id=node))
    clock.now += 0.7
    assert set(master.live_nodes()) == {"n0", "n2"}
    where = master.locate(keys)
    assert all(x and all(r.node_id != "n1" for r in x) for x in where.replicas)
    assert master.prefix(keys).prefix == 50
    assert all(len(t) == 2 and "n1" not in t for t in master.place(keys).targets)
    # A node the registry forgets (deregistered) takes its entries out of the index.
    registry.deregister("n1")
    master.locate(keys[:1])
    assert "n1" not in master.index.nodes()


def test_hot_keys_are_planned_onto_more_nodes_past_a_threshold() -> None:
    master, _, _ = cluster(4, 1, hot_threshold=3, hot_replicas=3)
    master.report(report("n0", 1, ["hot", "cold"], snapshot=True))
    for _ in range(2):
        master.note_hits(["hot", "cold"])
    assert master.hot_plan(["hot", "cold"]) == []
    master.note_hits(["hot"])
    plan = master.hot_plan(["hot", "cold"])
    assert [(t.key, t.source) for t in plan] == [("hot", "n0"), ("hot", "n0")]
    assert len({t.target for t in plan}) == 2 and all(t.target != "n0" for t in plan)
