"""Prefix oracles: the global index spread onto colocated prefill instances; one /store/exists."""

from __future__ import annotations

import json

import httpx

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler.oracle import (
    STORE_WIDE,
    IndexPrefixOracle,
    StoreExistsOracle,
)
from mooncake_server.wire.index import StorePrefixReply
from mooncake_server.wire.instances import InstanceInfo


def registry() -> InstanceRegistry:
    reg = InstanceRegistry(heartbeat_timeout_s=1e6)
    for iid, role, host in (("pA", "prefill", "hostA"), ("pB", "prefill", "hostB"),
                            ("sA", "store", "hostA"), ("sB", "store", "hostB")):
        reg.register(InstanceInfo(instance_id=iid, role=role, url=f"http://{host}:9{len(iid)}"))
    return reg


class Index:
    def prefix(self, keys: list[str]) -> StorePrefixReply:
        return StorePrefixReply(prefix=len(keys), by_node={"sA": 3, "sB": 1})


async def test_index_oracle_credits_the_store_node_on_the_same_host() -> None:
    hits = await IndexPrefixOracle(Index(), registry()).longest_prefix(["a", "b", "c", "d"])
    assert hits == {STORE_WIDE: 4, "sA": 3, "sB": 1, "pA": 3, "pB": 1}
    assert await IndexPrefixOracle(Index(), registry()).longest_prefix([]) == {}


async def test_exists_oracle_asks_one_store_and_survives_its_failure() -> None:
    calls: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        assert request.headers["x-mooncake-secret"] == "s"
        if len(calls) > 1:
            return httpx.Response(503)
        return httpx.Response(200, json={"exists": [True, True, False], "prefix": 2})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        oracle = StoreExistsOracle(registry(), http, "s")
        assert await oracle.longest_prefix(["a", "b", "c"]) == {STORE_WIDE: 2, "sA": 2}
        assert await oracle.longest_prefix(["a", "b", "c"]) == {}  # store failing: no hits
    assert calls[0] == {"keys": ["a", "b", "c"]}
