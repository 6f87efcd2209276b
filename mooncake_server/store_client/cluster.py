"""StoreCluster: put / get / exists / remove of blocks across every store node, via the index.

  get:  locate (the conductor's global index: live replicas per key, DRAM first) -> per node, one
        sparse get of the keys it was picked for, all nodes in parallel -> keys whose node failed
        or lacked them move to their next replica -> the leading run of blocks that arrived.
  put:  place (consistent hashing, K targets per key) -> per node, one put of its keys, in
        parallel -> a key is stored when at least one replica committed it. A node that failed
        is skipped for a few seconds so a dead node costs one timeout, not one per call.
Bytes move only through the transfer engine (StoreClient); the index only answers where.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx

from mooncake_server.store_client.client import Spans, StoreClient, StoreError
from mooncake_server.store_client.index_link import IndexLink
from mooncake_server.transfer import TransferEngine
from mooncake_server.wire.index import (
    StoreLocate,
    StoreLocateReply,
    StorePlace,
    StorePlaceReply,
)
from mooncake_server.wire.instances import StoreLocation
from mooncake_server.wire.routes import INDEX_LOCATE, INDEX_PLACE, INDEX_PREFIX
from mooncake_server.wire.store_ops import StoreKeys

logger = logging.getLogger(__name__)

_SUSPECT_S = 5.0  # how long a node that just failed is tried only as a last resort


class StoreUnavailable(StoreError):
    """No live store node could take a put: the caller keeps (or recomputes) the blocks."""


class StoreCluster:
    """Every store node as one object store, steered by the conductor's global index."""

    def __init__(self, master_url: str | Callable[[], str], engine: TransferEngine,
                 http: httpx.AsyncClient, secret: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Ask the index at `master_url` (the conductor; a callable: the one to ask now, as
        conductors come and go); `engine` and `http` are the caller's."""
        master = master_url if callable(master_url) else (lambda: master_url)
        self.index = IndexLink(master, http, secret)
        self._engine = engine
        self._http = http
        self._secret = secret
        self._clients: dict[str, StoreClient] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._suspect: dict[str, float] = {}
        self._clock = clock

    def client(self, loc: StoreLocation) -> StoreClient:
        """The (cached) client of one node; re-created if the node moved."""
        c = self._clients.get(loc.instance_id)
        if c is None or c.location != loc:
            if c is not None:
                closing = asyncio.create_task(c.aclose())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            c = StoreClient(loc, self._engine, self._http, self._secret)
            self._clients[loc.instance_id] = c
        return c

    async def aclose(self) -> None:
        """Close every node client (their control connections)."""
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*self._closing, *(c.aclose() for c in clients), self.index.aclose(),
                             return_exceptions=True)

    async def prefix_hits(self, keys: list[str]) -> int:
        """Leading keys held by some live node (one call to the index)."""
        if not keys:
            return 0
        reply = await self.index.ask(INDEX_PREFIX, StoreKeys(keys=keys))
        return reply.prefix

    async def place(self, keys: list[str], replicas: int | None = None,
                    preferred: list[str] | None = None,
                    skip_existing: bool = False) -> StorePlaceReply:
        """Where new keys go: K target nodes per key (one call to the index); with
        `skip_existing`, keys already held get none (`existing` says which)."""
        return await self.index.ask(INDEX_PLACE, StorePlace(keys=keys, replicas=replicas,
                                                       preferred=preferred or [],
                                                       skip_existing=skip_existing))

    async def locate(self, keys: list[str], *, fallback: bool = True,
                     lease: bool = False) -> StoreLocateReply:
        """Where each key's live copies are, and its size (one call to the index); with
        `lease`, keys found are leased at the master (a remove without force is refused)."""
        return await self.index.ask(INDEX_LOCATE, StoreLocate(keys=keys, fallback=fallback,
                                                         lease=lease))

    async def get(self, keys: list[str], addrs: list[int], sizes: list[int], *,
                  fallback: bool = True) -> int:
        """Read the leading blocks any live replica holds; return how many arrived.

        `fallback` also tries the ring targets of keys the index does not list yet (a reader
        right behind a writer); without it a key the index lacks ends the run at once.
        """
        if not len(keys) == len(addrs) == len(sizes):
            raise ValueError("get: keys, addrs and sizes must have the same length")
        if not keys:
            return 0
        where = await self.locate(keys, fallback=fallback)
        got = await self._fetch(where, keys, addrs, sizes, None, leading=True)
        return got.index(False) if False in got else len(got)

    async def get_each(self, where: StoreLocateReply, keys: list[str], addrs: list[int],
                       sizes: list[int], parts: Sequence[Spans] | None = None) -> list[bool]:
        """Read every key `where` (a `locate` answer for `keys`) lists, each on its own; per
        key whether it arrived. `parts`: per key, the pieces its bytes are scattered over."""
        if not len(keys) == len(addrs) == len(sizes) == len(where.replicas):
            raise ValueError("get_each: keys, addrs, sizes and replicas must match")
        return await self._fetch(where, keys, addrs, sizes, parts, leading=False)

    async def _fetch(self, where: StoreLocateReply, keys: list[str], addrs: list[int],
                     sizes: list[int], parts: Sequence[Spans] | None,
                     leading: bool) -> list[bool]:
        """Per key whether it arrived, trying each replica in turn; `leading` stops at the
        first key no replica could give (keys after it are of no use to such a reader)."""
        n = len(keys)
        run = next((i for i, r in enumerate(where.replicas) if not r), n) if leading else n
        options = [self._order([r.node_id for r in where.replicas[i]]) for i in range(n)]
        got = [False] * n
        tried = [0] * n
        while True:
            groups: dict[str, list[int]] = {}
            for i in range(run):
                if not got[i] and tried[i] < len(options[i]):
                    groups.setdefault(options[i][tried[i]], []).append(i)
            if not groups:
                break
            results = await asyncio.gather(*[
                self._get_from(where.nodes[node], idx, keys, addrs, sizes, parts)
                for node, idx in groups.items()])
            for idx, arrived in zip(groups.values(), results):
                for i, ok in zip(idx, arrived):
                    got[i] = ok
                    tried[i] += 1
            if leading:
                run = next((i for i in range(run)
                            if not got[i] and tried[i] >= len(options[i])), run)
        return got

    async def put(self, keys: list[str], addrs: list[int], sizes: list[int],
                  checksums: list[int], *, replicas: int | None = None,
                  preferred: list[str] | None = None,
                  parts: Sequence[Spans] | None = None) -> list[bool]:
        """Write blocks to their K nodes (`replicas`, default the master's; `preferred` nodes
        first); per key whether at least one replica holds it. `parts`: per key, the pieces
        its bytes are gathered from (`addrs` unused then).

        Raises StoreUnavailable when no live store node exists at all.
        """
        stored, _ = await self.put_where(keys, addrs, sizes, checksums, replicas=replicas,
                                         preferred=preferred, parts=parts)
        return stored

    async def put_where(self, keys: list[str], addrs: list[int], sizes: list[int],
                        checksums: list[int], *, replicas: int | None = None,
                        preferred: list[str] | None = None,
                        parts: Sequence[Spans] | None = None,
                        place: StorePlaceReply | None = None, pin_ms: int = 0,
                        ) -> tuple[list[bool], dict[str, list[int]]]:
        """`put`, also saying which node committed which keys (node id -> key indices);
        `place`: the index's answer for these keys, if the caller asked already; `pin_ms`:
        Mooncake's pin (StorePutStart)."""
        if not len(keys) == len(addrs) == len(sizes) == len(checksums):
            raise ValueError("put: keys, addrs, sizes and checksums must have the same length")
        if not keys:
            return [], {}
        if place is None:
            place = await self.place(keys, replicas, preferred)
        if not place.nodes and not any(place.existing):
            raise StoreUnavailable(f"no live store node can take {len(keys)} blocks")
        groups: dict[str, list[int]] = {}
        for i, targets in enumerate(place.targets):
            for node in targets:
                groups.setdefault(node, []).append(i)
        results = await asyncio.gather(*[
            self._put_to(place.nodes[node], idx, keys, addrs, sizes, checksums, parts, pin_ms)
            for node, idx in groups.items()])
        stored = list(place.existing) or [False] * len(keys)  # a key held already is stored
        holders: dict[str, list[int]] = {}
        for node, idx, ok in zip(groups, groups.values(), results):
            for i, s in zip(idx, ok):
                stored[i] = stored[i] or s
                if s:
                    holders.setdefault(node, []).append(i)
        return stored, holders

    async def remove(self, keys: list[str]) -> None:
        """Remove keys from every node that holds them (best effort per node)."""
        if not keys:
            return
        where = await self.index.ask(INDEX_LOCATE, StoreLocate(keys=keys))
        groups: dict[str, list[str]] = {}
        for key, reps in zip(keys, where.replicas):
            for r in reps:
                groups.setdefault(r.node_id, []).append(key)
        results = await asyncio.gather(*[self.client(where.nodes[n]).remove(ks)
                                         for n, ks in groups.items()], return_exceptions=True)
        for node, res in zip(groups, results):
            if isinstance(res, Exception):
                logger.warning("removing %d keys from store %s failed: %s",
                               len(groups[node]), node, res)

    # ---- internals ----------------------------------------------------------------------------

    def _order(self, nodes: Sequence[str]) -> list[str]:
        """Replicas in the index's order, nodes that failed recently last."""
        now = self._clock()
        return sorted(nodes, key=lambda n: self._suspect.get(n, 0.0) > now)

    def _failed(self, node: str, exc: Exception) -> None:
        logger.warning("store node %s failed: %s", node, exc)
        self._suspect[node] = self._clock() + _SUSPECT_S

    async def _get_from(self, loc: StoreLocation, idx: list[int], keys: list[str],
                        addrs: list[int], sizes: list[int],
                        parts: Sequence[Spans] | None = None) -> list[bool]:
        try:
            if parts is not None:
                return await self.client(loc).get_parts([keys[i] for i in idx],
                                                        [parts[i] for i in idx])
            return await self.client(loc).get_any([keys[i] for i in idx],
                                                  [addrs[i] for i in idx],
                                                  [sizes[i] for i in idx])
        except StoreError as exc:
            self._failed(loc.instance_id, exc)
            return [False] * len(idx)

    async def _put_to(self, loc: StoreLocation, idx: list[int], keys: list[str],
                      addrs: list[int], sizes: list[int], checksums: list[int],
                      parts: Sequence[Spans] | None = None, pin_ms: int = 0) -> list[bool]:
        try:
            return await self.client(loc).put([keys[i] for i in idx], [addrs[i] for i in idx],
                                              [sizes[i] for i in idx],
                                              [checksums[i] for i in idx],
                                              [parts[i] for i in idx] if parts else None,
                                              pin_ms)
        except StoreError as exc:
            self._failed(loc.instance_id, exc)
            return [False] * len(idx)
