"""The Mooncake API's async side: the same `StoreCluster` our prefill and decode roles use, the
master's client calls (leases, commits, drops), and the mounted segment.

Every call answers per key with Mooncake's conventions: 0 / bytes read, or a negative
`ErrorCode`. Bytes move only through the transfer engine, straight between the caller's memory
and a store node's pool; the master is asked where, never sent bytes.
  put:    place (write-once: keys held already are skipped and answered 0) -> per node
          put_start / WRITE / put_end -> the master indexes the commits at once
  get:    locate (leased at the master) -> per key, exact pieces inside the caller's buffers ->
          READ (or GET by key over TCP), CRC32C checked -> bytes read
  remove: the master drops the keys (a leased one stays unless force) -> the holders remove
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from mooncake_server.mooncake_api.memory import Regions, Staging
from mooncake_server.mooncake_api.segment import MountedSegment
from mooncake_server.mooncake_api.settings import ClientSettings
from mooncake_server.mooncake_api.surface import ErrorCode, ReplicateConfig
from mooncake_server.store_client.client import Spans, StoreError
from mooncake_server.store_client.cluster import StoreCluster, StoreUnavailable
from mooncake_server.store_client.index_link import IndexRefused
from mooncake_server.transfer import TransferEngine, TransferError
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.index import StoreCommitted, StoreDrop, StoreLocateReply
from mooncake_server.wire.routes import INDEX_COMMITTED, INDEX_DROP

log = logging.getLogger(__name__)

SEGMENT_NAME = "mooncake-client-segment"
_TRANSPORTS = {"tcp": "tcp", "rdma": "rdma", "shm": "shm", "auto": "auto"}


class MasterRefused(RuntimeError):
    """The master refused this client (wrong or missing cluster secret)."""


class ApiCore:
    """One client's engine, cluster view and (optionally) mounted segment."""

    def __init__(self, settings: ClientSettings, timeout_s: float = 10.0) -> None:
        """Connect nothing yet (`start` does)."""
        self.settings = settings
        self.timeout_s = timeout_s
        self.engine: TransferEngine | None = None
        self.http: httpx.AsyncClient | None = None
        self.cluster: StoreCluster | None = None
        self.segment: MountedSegment | None = None
        self.regions: Regions | None = None
        self.staging: Staging | None = None
        self._headers = secret_headers(settings.secret)

    @property
    def hostname(self) -> str:
        """This client's host:port (its segment's name when it mounts one)."""
        if self.engine is not None and self.segment is not None:
            return self.engine.address
        s = self.settings
        return f"{s.host}:{s.port}" if s.port else s.host

    async def start(self) -> None:
        """Engine, master check (raises MasterRefused / StoreError), mounted segment."""
        s = self.settings
        mount = s.global_segment_size > 0
        self.engine = TransferEngine(secret=s.secret.encode(), listen_host=s.host,
                                     listen_port=s.port if mount else 0,
                                     transport=_TRANSPORTS[s.protocol], serve=mount,
                                     timeout_s=self.timeout_s,
                                     rdma_device=s.rdma_devices.split(",")[0] or None)
        self.regions = Regions(self.engine)
        self.staging = Staging(self.engine, s.local_buffer_size)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0),
                                      headers=self._headers)
        self.cluster = StoreCluster(s.master_url, self.engine, self.http, s.secret)
        await self._check_master()
        if mount:
            self.segment = MountedSegment(self.engine, SEGMENT_NAME, s.global_segment_size,
                                          s.host, s.master_url, s.secret)
            await self.segment.start()

    async def _check_master(self) -> None:
        assert self.http is not None
        try:
            reply = await self.http.post(f"{self.settings.master_url}/internal/store/prefix",
                                         json={"keys": []})
        except httpx.HTTPError as exc:
            raise StoreError(f"store master {self.settings.master_url} unreachable: "
                             f"{exc!r}") from exc
        if reply.status_code in (401, 403):
            raise MasterRefused(f"store master {self.settings.master_url} refused this client: "
                                "set MOONCAKE_CLUSTER_SECRET to the cluster's secret")
        if reply.status_code != 200:
            raise StoreError(f"store master {self.settings.master_url}: HTTP "
                             f"{reply.status_code}")

    async def close(self) -> None:
        """Unmount (the master forgets the segment's data), close connections and the engine."""
        if self.segment is not None:
            await self.segment.close()
            self.segment = None
        if self.cluster is not None:
            await self.cluster.aclose()
        if self.http is not None:
            await self.http.aclose()
        if self.regions is not None:
            self.regions.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ---- writes -------------------------------------------------------------------------------

    async def put(self, keys: list[str], parts: Sequence[Spans], checksums: list[int],
                  config: ReplicateConfig, replace: bool = False) -> list[int]:
        """Store each key's pieces as one object; per key 0 or a negative ErrorCode. Without
        `replace` a key held already is kept (Mooncake's write-once put)."""
        cluster = self._cluster()
        if replace:
            await self.drop(StoreDrop(keys=keys, force=True))
        sizes = [sum(n for _, n in p) for p in parts]
        single = all(len(p) == 1 for p in parts)
        try:
            place = await cluster.place(keys, config.replica_num, config.preferred(),
                                        skip_existing=True)
            stored, holders = await cluster.put_where(
                keys, [p[0][0] for p in parts], sizes, checksums, place=place,
                parts=None if single else parts, pin_ms=config.pin_ms())
        except StoreUnavailable:
            return [ErrorCode.NO_AVAILABLE_HANDLE] * len(keys)
        except (StoreError, TransferError) as exc:
            log.warning("put of %d keys failed: %s", len(keys), exc)
            return [ErrorCode.TRANSFER_FAIL] * len(keys)
        await asyncio.gather(*[self._committed(node, [keys[i] for i in idx],
                                               [sizes[i] for i in idx])
                               for node, idx in holders.items()])
        return [ErrorCode.OK if ok else ErrorCode.NO_AVAILABLE_HANDLE for ok in stored]

    async def _committed(self, node: str, keys: list[str], sizes: list[int]) -> None:
        try:
            await self._cluster().index.ask(
                INDEX_COMMITTED, StoreCommitted(node_id=node, keys=keys, sizes=sizes))
        except StoreError as exc:
            # The node's own report indexes them a few milliseconds later.
            log.debug("telling the master of %d commits failed: %s", len(keys), exc)

    # ---- reads --------------------------------------------------------------------------------

    async def locate(self, keys: list[str], lease: bool = False) -> StoreLocateReply:
        """Where each key lives and its size (None: not held); StoreError if the master fails."""
        return await self._cluster().locate(keys, fallback=False, lease=lease)

    async def get(self, keys: list[str], room: Sequence[Spans]) -> list[int]:
        """Read each key into the caller's pieces (`room`: per key, (address, capacity)
        pieces, filled in order); per key the bytes read or a negative ErrorCode."""
        try:
            where = await self.locate(keys, lease=True)
        except StoreError as exc:
            log.warning("locating %d keys failed: %s", len(keys), exc)
            return [ErrorCode.RPC_FAIL] * len(keys)
        return await self._read(where, keys, room)

    async def get_owned(self, keys: list[str]) -> list[tuple[Any, int]]:
        """Read each key into a new buffer of its size: per key (buffer, bytes read), or
        (None, a negative ErrorCode)."""
        try:
            where = await self.locate(keys, lease=True)
        except StoreError as exc:
            log.warning("locating %d keys failed: %s", len(keys), exc)
            return [(None, ErrorCode.RPC_FAIL)] * len(keys)
        staging = self._staging()
        with contextlib.ExitStack() as stack:
            owned = [stack.enter_context(staging.own(size or 0)) for size in where.sizes]
            codes = await self._read(where, keys, [[(addr, size or 0)] for (addr, _), size
                                                   in zip(owned, where.sizes)])
        return [(buf if c >= 0 else None, c) for (_, buf), c in zip(owned, codes)]

    async def _read(self, where: StoreLocateReply, keys: list[str],
                    room: Sequence[Spans]) -> list[int]:
        codes: list[int] = [0] * len(keys)
        todo: list[int] = []
        exact: list[list[tuple[int, int]]] = []
        for i, (size, reps) in enumerate(zip(where.sizes, where.replicas)):
            pieces = _fill(room[i], size) if size is not None and reps else None
            if size is None or not reps:
                codes[i] = ErrorCode.OBJECT_NOT_FOUND
            elif pieces is None:
                codes[i] = ErrorCode.INVALID_PARAMS  # the caller's buffer is too small
            elif len(room[i]) > 1 and sum(n for _, n in room[i]) != size:
                # NOTE: as Mooncake: several buffers must add up to the object exactly.
                codes[i] = ErrorCode.TRANSFER_FAIL
            else:
                todo.append(i)
                exact.append(pieces)
        if not todo:
            return codes
        sub = StoreLocateReply(nodes=where.nodes, replicas=[where.replicas[i] for i in todo],
                               sizes=[where.sizes[i] for i in todo])
        single = all(len(p) == 1 for p in exact)
        try:
            arrived = await self._cluster().get_each(
                sub, [keys[i] for i in todo], [p[0][0] for p in exact],
                [sum(n for _, n in p) for p in exact], None if single else exact)
        except (StoreError, TransferError) as exc:
            log.warning("reading %d keys failed: %s", len(todo), exc)
            arrived = [False] * len(todo)
        for i, ok, pieces in zip(todo, arrived, exact):
            codes[i] = sum(n for _, n in pieces) if ok else ErrorCode.TRANSFER_FAIL
        return codes

    async def exist(self, keys: list[str]) -> list[int]:
        """Per key 1 (held), 0 (not) or a negative ErrorCode; a key found is leased, as
        Mooncake's master leases keys it answers for."""
        try:
            where = await self.locate(keys, lease=True)
        except StoreError:
            return [ErrorCode.RPC_FAIL] * len(keys)
        return [1 if reps else 0 for reps in where.replicas]

    # ---- removes ------------------------------------------------------------------------------

    async def drop(self, body: StoreDrop) -> list[int]:
        """Remove keys (named, by regex, or all); per key considered 0 or a negative code."""
        try:
            reply = await self._cluster().index.ask(INDEX_DROP, body)
        except IndexRefused as exc:
            raise ValueError(exc.detail) from None
        except StoreError:
            return [ErrorCode.RPC_FAIL] * max(1, len(body.keys))
        cluster = self._cluster()
        by_node: dict[str, list[str]] = {}
        for key, code, holders in zip(reply.keys, reply.codes, reply.holders):
            for node in holders if code == 0 else []:
                by_node.setdefault(node, []).append(key)
        results = await asyncio.gather(*[cluster.client(reply.nodes[n]).remove(ks)
                                         for n, ks in by_node.items()], return_exceptions=True)
        for node, res in zip(by_node, results):
            if isinstance(res, Exception):
                log.warning("removing %d keys from store %s failed: %s", len(by_node[node]),
                            node, res)
        return list(reply.codes)

    async def healthy(self) -> bool:
        """The master answers this client."""
        try:
            await self._check_master()
        except (StoreError, MasterRefused):
            return False
        return True

    def _cluster(self) -> StoreCluster:
        if self.cluster is None:
            raise RuntimeError("not set up")
        return self.cluster

    def _staging(self) -> Staging:
        if self.staging is None:
            raise RuntimeError("not set up")
        return self.staging

    def _http(self) -> httpx.AsyncClient:
        if self.http is None:
            raise RuntimeError("not set up")
        return self.http


def _fill(room: Spans, size: int) -> list[tuple[int, int]] | None:
    """The leading pieces of `room` that hold exactly `size` bytes (None: room is too small)."""
    out, left = [], size
    for addr, cap in room:
        if left <= 0:
            break
        n = min(cap, left)
        out.append((addr, n))
        left -= n
    if left > 0:
        return None
    return out or [(room[0][0] if room else 0, 0)]

