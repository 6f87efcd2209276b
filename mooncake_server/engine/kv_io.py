"""Moves blocks of a local paged KV cache to and from store nodes (bytes via the transfer engine)."""

from __future__ import annotations

import asyncio

import httpx

from mooncake_server.engine.kv_cache import PagedKVCache
from mooncake_server.messages import StoreLocation
from mooncake_server.store.client import StoreClient
from mooncake_server.transfer import TransferEngine, crc32c


class KVStoreLink:
    """One role's view of the store: cached clients per node, block addresses, checksums."""

    def __init__(self, kv: PagedKVCache, engine: TransferEngine, http: httpx.AsyncClient,
                 secret: str) -> None:
        self.kv = kv
        self.engine = engine
        self.http = http
        self.secret = secret
        self._clients: dict[str, StoreClient] = {}

    def client(self, loc: StoreLocation) -> StoreClient:
        """The (cached) client of one store node; re-created if the node moved."""
        c = self._clients.get(loc.instance_id)
        if c is None or c.location != loc:
            c = StoreClient(loc, self.engine, self.http, self.secret)
            self._clients[loc.instance_id] = c
        return c

    def _addrs(self, block_ids: list[int]) -> tuple[list[int], list[int]]:
        bb = self.kv.layout.block_bytes
        return [self.kv.block_addr(b) for b in block_ids], [bb] * len(block_ids)

    async def load(self, loc: StoreLocation, keys: list[str], block_ids: list[int]) -> int:
        """Read blocks `keys` into local `block_ids`; returns how many leading ones arrived."""
        if not keys:
            return 0
        addrs, sizes = self._addrs(block_ids[:len(keys)])
        return await self.client(loc).get(keys, addrs, sizes)

    async def save(self, loc: StoreLocation, keys: list[str], block_ids: list[int],
                   checksums: list[int]) -> list[bool]:
        """Write local blocks under `keys`; per key whether the store now holds it."""
        if not keys:
            return []
        addrs, sizes = self._addrs(block_ids)
        return await self.client(loc).put(keys, addrs, sizes, checksums)

    async def checksums(self, block_ids: list[int]) -> list[int]:
        """CRC32C of each block's bytes (native, GIL released, so done in a thread)."""
        bb = self.kv.layout.block_bytes

        def run() -> list[int]:
            return [crc32c(self.kv.block_addr(b), bb) for b in block_ids]

        return await asyncio.to_thread(run)
