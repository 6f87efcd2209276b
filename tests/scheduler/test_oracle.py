"""The prefix oracle: the global index spread onto colocated prefill instances."""

from __future__ import annotations

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler.oracle import STORE_WIDE, IndexPrefixOracle
from mooncake_server.wire.index import StorePrefixReply
from mooncake_server.wire.instances import InstanceInfo


def registry() -> InstanceRegistry:
    reg = InstanceRegistry(heartbeat_timeout_s=1e6)
    for iid, role, host in (("pA", "prefill", "hostA"), ("pB", "prefill", "hostB"),
                            ("sA", "store", "hostA"), ("sB", "store", "hostB")):
        reg.register(InstanceInfo(instance_id=iid, role=role, url=f"http://{host}:9{len(iid)}"))
    return reg


class Index:
    async def prefix(self, keys: list[str]) -> StorePrefixReply:
        return StorePrefixReply(prefix=len(keys), by_node={"sA": 3, "sB": 1})


async def test_index_oracle_credits_the_store_node_on_the_same_host() -> None:
    hits = await IndexPrefixOracle(Index(), registry()).longest_prefix(["a", "b", "c", "d"])
    assert hits == {STORE_WIDE: 4, "sA": 3, "sB": 1, "pA": 3, "pB": 1}
    assert await IndexPrefixOracle(Index(), registry()).longest_prefix([]) == {}
