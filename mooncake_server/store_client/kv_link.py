"""Moves blocks of a local paged KV cache to and from the store cluster (bytes via the transfer
engine, placement and replicas from the conductor's global store index)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from mooncake_server.engine.kv_cache import PagedKVCache
from mooncake_server.store_client.client import StoreClient
from mooncake_server.store_client.cluster import StoreCluster
from mooncake_server.transfer import TransferEngine, crc32c
from mooncake_server.wire.instances import StoreLocation


class KVStoreLink:
    """One role's view of the store: the cluster client, block addresses, checksums."""

    def __init__(self, kv: PagedKVCache, engine: TransferEngine, http: httpx.AsyncClient,
                 secret: str, master_url: str | Callable[[], str]) -> None:
        """Blocks of `kv`; `master_url` is (or names, when called) the conductor holding the
        global store index."""
        self.kv = kv
        self.engine = engine
        self.cluster = StoreCluster(master_url, engine, http, secret)

    def client(self, loc: StoreLocation) -> StoreClient:
        """The (cached) client of one store node; re-created if the node moved."""
        return self.cluster.client(loc)

    async def aclose(self) -> None:
        """Close the control connections to store nodes."""
        await self.cluster.aclose()

    def _addrs(self, block_ids: list[int]) -> tuple[list[int], list[int]]:
        bb = self.kv.layout.block_bytes
        return [self.kv.block_addr(b) for b in block_ids], [bb] * len(block_ids)

    async def load(self, keys: list[str], block_ids: list[int], *, fallback: bool = True) -> int:
        """Read blocks `keys` into local `block_ids`; returns how many leading ones arrived.

        `fallback=False` trusts the index alone (a prefix lookup); True also tries where blocks
        were just written but not yet indexed (a reader right behind the writer).
        """
        if not keys:
            return 0
        addrs, sizes = self._addrs(block_ids[:len(keys)])
        return await self.cluster.get(keys, addrs, sizes, fallback=fallback)

    async def save(self, keys: list[str], block_ids: list[int],
                   checksums: list[int]) -> list[bool]:
        """Write local blocks under `keys`; per key whether some store node now holds it."""
        if not keys:
            return []
        addrs, sizes = self._addrs(block_ids)
        return await self.cluster.put(keys, addrs, sizes, checksums)

    async def remove(self, keys: list[str]) -> None:
        """Remove keys from every store node holding them."""
        await self.cluster.remove(keys)

    async def checksums(self, block_ids: list[int]) -> list[int]:
        """CRC32C of each block's bytes (native, GIL released, so done in a thread)."""
        bb = self.kv.layout.block_bytes

        def run() -> list[int]:
            return [crc32c(self.kv.block_addr(b), bb) for b in block_ids]

        return await asyncio.to_thread(run)
