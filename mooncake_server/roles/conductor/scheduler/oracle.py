"""Where a request's prefix is cached: the `PrefixOracle` the scheduler asks once per request.

`longest_prefix(keys)` answers, in leading *blocks* of `keys`:
  - `STORE_WIDE` ("*"): the longest prefix cached anywhere in the global store (all nodes);
  - a prefill instance id: the longest prefix that instance can use without a network transfer:
    its own prefix cache as it reports it (`LocalCacheIndex`), or, without such reports, a store
    node on the same host;
  - a store node id: the longest prefix that node alone holds.
Missing instances mean 0. It is answered from the conductor's global store index (no I/O); the
request path reuses the same answer (`Plan.cached_blocks`) to count hits on hot blocks, so the
index is walked once per request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.wire.index import StorePrefixReply

log = logging.getLogger(__name__)

STORE_WIDE = "*"


class PrefixOracle(Protocol):
    """Longest cached prefix of a request's block keys, per instance and store-wide."""

    async def longest_prefix(self, keys: Sequence[str]) -> dict[str, int]:
        """Leading cached blocks of `keys`: `STORE_WIDE` -> store-wide, instance id -> local.

        Args:
            keys: the request's chained block keys, in prompt order.
        Returns:
            blocks, never more than len(keys); absent entries mean 0.
        """
        ...


class PrefixIndex(Protocol):
    """The part of the conductor's store master the oracle needs (`MasterLink.prefix`)."""

    async def prefix(self, keys: list[str]) -> StorePrefixReply:
        """Longest prefix cached anywhere, and per live node."""
        ...


def _host(url: str) -> str:
    return urlsplit(url).hostname or url


class NoPrefixOracle:
    """Nothing is ever cached (tests, or a cluster without a store)."""

    async def longest_prefix(self, keys: Sequence[str]) -> dict[str, int]:
        """Always empty."""
        return {}


class LocalIndex(Protocol):
    """What prefill instances hold in their own caches (`LocalCacheIndex.prefix`)."""

    def prefix(self, instance_id: str, keys: list[str]) -> int:
        """Leading keys the instance holds."""
        ...


class IndexPrefixOracle:
    """Answers from the conductor's global store index and, with `local`, from the prefill
    instances' reports of their own caches. Without `local`, a store node is local to the
    prefill instances on its host (the paper's deployment: the store pool is the prefill
    nodes' DRAM)."""

    def __init__(self, index: PrefixIndex, registry: InstanceRegistry,
                 local: LocalIndex | None = None) -> None:
        self._index = index
        self._registry = registry
        self._local = local

    async def longest_prefix(self, keys: Sequence[str]) -> dict[str, int]:
        """One in-memory index query, spread onto colocated prefill instances."""
        if not keys:
            return {}
        reply = await self._index.prefix(list(keys))
        hits: dict[str, int] = {STORE_WIDE: reply.prefix, **reply.by_node}
        if self._local is not None:
            for prefill in self._registry.alive("prefill"):
                local = self._local.prefix(prefill.instance_id, list(keys))
                if local:
                    hits[prefill.instance_id] = local
            return hits
        by_host: dict[str, int] = {}
        for node_id, blocks in reply.by_node.items():
            info = self._registry.get(node_id)
            url = reply.urls.get(node_id) or (info.url if info is not None else None)
            if url is not None:  # NOTE: a standalone master's nodes are not in our registry
                host = _host(url)
                by_host[host] = max(by_host.get(host, 0), blocks)
        for info in self._registry.alive("prefill"):
            local = by_host.get(_host(info.url), 0)
            if local:
                hits[info.instance_id] = local
        return hits
