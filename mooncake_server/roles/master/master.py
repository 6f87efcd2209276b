"""The store master: the one global index, placement, read leases and hot-block copies. It runs
as its own process (`--role master`, roles/master/app.py) or inside the conductor (the default).

Store nodes report what they hold (a snapshot when they (re)start, then deltas: commit, evict,
demote, rehydrate, remove) to POST /internal/store/report. Engine roles ask where keys live
(`locate`) and where new keys go (`place`); the conductor asks, once per request, for the longest
cached prefix over the cluster and per node (`prefix`). Placement is consistent hashing over the
live store nodes with `replicas` copies; a key many requests hit gains copies on more nodes
(`replicate_hot`, paper §4.2), which the target nodes pull from a holder over the transfer engine.
Store clients (mooncake_api) also ask it to lease keys they read (`locate` with
`lease_ms`: a remove without force is refused until the lease ends, as Mooncake's master does),
to index their commits at once (`committed`) and to drop keys they remove (`drop`).
Every route needs the cluster secret. Reports also have a binary channel (`serve_index_channel`,
rpc.py): a node's first report goes over HTTP, whose answer names the channel, and later ones
cost the node and the conductor tens of microseconds instead of an HTTP request each (~1 ms of
CPU on either side, which readers on the same cores would otherwise wait behind).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import httpx
from fastapi import APIRouter, Depends, HTTPException
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.master.index import GlobalIndex
from mooncake_server.roles.master.placement import HashRing
from mooncake_server.wire.auth import require_secret, secret_headers
from mooncake_server.wire.index import (
    HAS_LEASE,
    NOT_FOUND,
    IndexOp,
    StoreCommitted,
    StoreDrop,
    StoreDropReply,
    StoreLocate,
    StoreLocateReply,
    StorePlace,
    StorePlaceReply,
    StorePrefixReply,
    StoreReplica,
    StoreReplicate,
    StoreReport,
    StoreReportReply,
)
from mooncake_server.wire.instances import StoreLocation
from mooncake_server.wire.routes import (
    INDEX_COMMITTED,
    INDEX_DROP,
    INDEX_LOCATE,
    INDEX_PLACE,
    INDEX_PREFIX,
    INDEX_REPORT,
    INDEX_REUSE,
    INDEX_STATS,
    STORE_REPLICATE,
    CallError,
    PeerRefused,
    call,
    serve,
)
from mooncake_server.wire.rpc import Handler, RpcServer, json_handler
from mooncake_server.wire.store_ops import StoreKeys

log = logging.getLogger(__name__)

# Mooncake's default: a key read stays leased 5 s (mooncake_master --default_kv_lease_ttl).
DEFAULT_LEASE_S = 5.0


class CopyTask(NamedTuple):
    """Copy one key from a node holding it to one more node."""

    key: str
    size: int
    source: str
    target: str


class StoreMaster:
    """Global index + placement over the live store nodes of one registry."""

    def __init__(self, registry: InstanceRegistry, replicas: int, secret: str, *,
                 hot_threshold: int = 8, hot_replicas: int | None = None,
                 max_tracked_keys: int = 200_000, lease_s: float = DEFAULT_LEASE_S) -> None:
        """`replicas` copies per key; keys hit `hot_threshold` times get `hot_replicas` copies;
        a key read with a lease is kept from removal `lease_s` seconds.

        `hot_replicas` None means every live node.
        """
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if hot_threshold < 1:
            raise ValueError(f"hot_threshold must be at least 1, got {hot_threshold}")
        self.replicas = replicas
        self.hot_threshold = hot_threshold
        self.hot_replicas = hot_replicas
        self.index = GlobalIndex()
        self._registry = registry
        self._headers = secret_headers(secret)
        self._ring: HashRing | None = None
        self._hits: Counter[str] = Counter()
        self._max_tracked = max_tracked_keys
        self._copying: set[tuple[str, str]] = set()
        self.copies_requested = 0
        self.copies_made = 0
        self.channel: str | None = None  # host:port of the binary report channel, once served
        self.lease_s = lease_s
        self._leases: dict[str, float] = {}  # key -> monotonic end of its read lease
        self._background: set[asyncio.Task[int]] = set()

    # ---- membership ---------------------------------------------------------------------------

    def live_nodes(self) -> dict[str, StoreLocation]:
        """Live store nodes that can be reached over the transfer engine."""
        nodes = {}
        for info in self._registry.alive("store"):
            loc = StoreLocation.of(info)
            if loc is not None:
                nodes[info.instance_id] = loc
        return nodes

    def ring(self, alive: dict[str, StoreLocation]) -> HashRing:
        """The hash ring over `alive` (rebuilt only when membership changes)."""
        if self._ring is None or self._ring.nodes != tuple(sorted(alive)):
            self._ring = HashRing(alive)
        return self._ring

    def _purge_departed(self) -> None:
        # Nodes the registry forgot (deregistered, long silent) take their entries with them;
        # a node that is merely stale keeps them (filtered out until it comes back).
        for node in self.index.nodes():
            if self._registry.get(node) is None:
                log.info("store node %s left: dropped %d index entries", node,
                         self.index.drop_node(node))

    # ---- queries ------------------------------------------------------------------------------

    def report(self, report: StoreReport) -> StoreReportReply:
        """Apply a node's snapshot or delta."""
        if self._registry.get(report.node_id) is None and not report.snapshot:
            return StoreReportReply(accepted=False, resync=True)
        ok = self.index.apply(report)
        if report.snapshot:
            log.info("store node %s reported %d objects", report.node_id, len(report.entries))
        return StoreReportReply(accepted=ok, resync=not ok, channel=self.channel)

    def rpc_handlers(self) -> dict[int, Handler]:
        """The binary channel's ops: JSON payload in, JSON reply out."""
        return {
            int(IndexOp.REPORT): json_handler(StoreReport, self.report),
            int(IndexOp.LOCATE): json_handler(
                StoreLocate, lambda b: self.locate(b.keys, b.fallback, b.lease)),
            int(IndexOp.PLACE): json_handler(
                StorePlace, lambda b: self.place(b.keys, b.replicas, b.preferred,
                                                 b.skip_existing)),
            int(IndexOp.COMMITTED): self._committed_frame,
            int(IndexOp.DROP): json_handler(StoreDrop, self.drop),
        }

    def _committed_frame(self, payload: bytes) -> bytes:
        # The reply is INDEX_COMMITTED's, {"ok": true}, not a model: json_handler does not fit.
        try:
            body = StoreCommitted.model_validate_json(payload)
        except ValidationError as exc:
            raise ValueError("malformed StoreCommitted: "
                             f"{exc.errors(include_url=False)[:3]}") from None
        self.committed(body)
        return b'{"ok":true}'

    def locate(self, keys: list[str], fallback: bool = True,
               lease: bool = False) -> StoreLocateReply:
        """Live replicas of each key; keys the index lacks get their ring targets (fallback);
        with `lease`, keys found are leased for `lease_s`."""
        self._purge_departed()
        alive = self.live_nodes()
        ring = self.ring(alive)
        replicas: list[list[StoreReplica]] = []
        used: set[str] = set()
        for key in keys:
            found = self.index.replicas(key, alive)
            if found or not fallback:
                reps = [StoreReplica(node_id=n, tier=t) for n, t in found]
            else:
                # NOTE: a commit may not have reached the index yet; its writer put it here.
                reps = [StoreReplica(node_id=n, tier="unknown")
                        for n in ring.targets(key, self.replicas)] if alive else []
            if found and lease:
                self._leases[key] = time.monotonic() + self.lease_s
            used.update(r.node_id for r in reps)
            replicas.append(reps)
        return StoreLocateReply(nodes={n: alive[n] for n in used}, replicas=replicas,
                                sizes=[self.index.size_of(k) for k in keys],
                                channel=self.channel)

    def place(self, keys: list[str], replicas: int | None = None,
              preferred: list[str] | None = None,
              skip_existing: bool = False) -> StorePlaceReply:
        """Ring targets of each key over the live nodes (`replicas` of them, default the
        master's), the live `preferred` nodes (ids or transfer addresses) first; with
        `skip_existing`, keys some live node holds get none."""
        alive = self.live_nodes()
        existing = ([bool(self.index.replicas(k, alive)) for k in keys] if skip_existing
                    else [])
        if not alive:
            return StorePlaceReply(nodes={}, targets=[[] for _ in keys], existing=existing,
                                   channel=self.channel)
        ring = self.ring(alive)
        want = min(replicas or self.replicas, len(alive))
        first = [n for p in preferred or [] for n, loc in alive.items()
                 if p in (n, loc.transfer_address)]
        targets = []
        for i, key in enumerate(keys):
            if existing and existing[i]:
                targets.append([])
                continue
            picked = list(dict.fromkeys(first))[:want]
            picked += [n for n in ring.targets(key, len(alive)) if n not in picked]
            targets.append(picked[:want])
        used = {n for t in targets for n in t}
        return StorePlaceReply(nodes={n: alive[n] for n in used}, targets=targets,
                               existing=existing, channel=self.channel)

    def prefix(self, keys: list[str]) -> StorePrefixReply:
        """Longest prefix cached anywhere, and per live node (with the nodes' URLs)."""
        alive = self.live_nodes()
        prefix, by_node = self.index.prefixes(keys, alive)
        return StorePrefixReply(prefix=prefix, by_node=by_node,
                                urls={n: loc.url for n, loc in alive.items()})

    # ---- store clients (mooncake_api) ---------------------------------------------------------

    def committed(self, body: StoreCommitted) -> None:
        """Index a client's just-committed keys on their node."""
        if len(body.keys) != len(body.sizes):
            raise ValueError("committed: one size per key")
        for key, size in zip(body.keys, body.sizes):
            self.index.note(body.node_id, key, size)

    def drop(self, body: StoreDrop) -> StoreDropReply:
        """Take keys out of the index for a client's remove; a leased key stays unless force."""
        if body.all:
            keys = self.index.keys()
        elif body.regex is not None:
            try:
                pattern = re.compile(body.regex)
            except re.error as exc:
                raise ValueError(f"remove_by_regex: invalid pattern: {exc}") from None
            keys = [k for k in self.index.keys() if pattern.search(k)]
        else:
            keys = body.keys
        now = time.monotonic()
        alive = self.live_nodes()
        codes, holders = [], []
        for key in keys:
            if self.index.size_of(key) is None:
                codes.append(NOT_FOUND)
                holders.append([])
            elif not body.force and self._leases.get(key, 0.0) > now:
                codes.append(HAS_LEASE)
                holders.append([])
            else:
                self._leases.pop(key, None)
                codes.append(0)
                holders.append([n for n in self.index.forget(key) if n in alive])
        self._expire_leases(now)
        used = {n for h in holders for n in h}
        return StoreDropReply(keys=keys, codes=codes, holders=holders,
                              nodes={n: alive[n] for n in used})

    def _expire_leases(self, now: float) -> None:
        if len(self._leases) > 4 * max(16, self.index.stats().keys):
            self._leases = {k: t for k, t in self._leases.items() if t > now}

    # ---- hot blocks ---------------------------------------------------------------------------

    def note_hits(self, keys: list[str]) -> None:
        """Count one more request reusing these cached keys."""
        self._hits.update(keys)
        if len(self._hits) > self._max_tracked:
            # Halve every count and drop the zeros: bounded memory, recent popularity wins.
            self._hits = Counter({k: c // 2 for k, c in self._hits.items() if c // 2})

    def hot_plan(self, keys: list[str]) -> list[CopyTask]:
        """Copies that would bring the hot keys among `keys` to their hot replica count."""
        alive = self.live_nodes()
        want = min(len(alive), self.hot_replicas or len(alive))
        if want <= self.replicas:
            return []
        ring = self.ring(alive)
        plan: list[CopyTask] = []
        for key in keys:
            if self._hits.get(key, 0) < self.hot_threshold:
                continue
            holders = self.index.replicas(key, alive)
            size = self.index.size_of(key)
            if not holders or size is None or len(holders) >= want:
                continue
            have = {n for n, _ in holders}
            extra = [n for n in ring.targets(key, len(alive)) if n not in have]
            for target in extra[:want - len(holders)]:
                if (key, target) not in self._copying:
                    plan.append(CopyTask(key, size, holders[0][0], target))
        return plan

    def reuse(self, keys: list[str], http: httpx.AsyncClient) -> int:
        """Count a request reusing `keys`; hot ones gain copies in the background. Returns how
        many copies were asked for."""
        self.note_hits(keys)
        plan = self.hot_plan(keys)
        if plan:
            task = asyncio.get_running_loop().create_task(self.replicate_hot(keys, http, plan))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return len(plan)

    async def replicate_hot(self, keys: list[str], http: httpx.AsyncClient,
                            plan: list[CopyTask] | None = None) -> int:
        """Ask nodes to copy the hot keys among `keys` (`plan`: their `hot_plan`, if the
        caller has it already); return how many copies were made."""
        plan = self.hot_plan(keys) if plan is None else plan
        if not plan:
            return 0
        alive = self.live_nodes()
        groups: dict[tuple[str, str], list[CopyTask]] = {}
        for task in plan:
            groups.setdefault((task.source, task.target), []).append(task)
            self._copying.add((task.key, task.target))
        self.copies_requested += len(plan)
        try:
            results = await asyncio.gather(*[
                self._copy(alive[target], alive[source], tasks, http)
                for (source, target), tasks in groups.items()])
        finally:
            for task in plan:
                self._copying.discard((task.key, task.target))
        made = sum(results)
        self.copies_made += made
        return made

    async def _copy(self, target: StoreLocation, source: StoreLocation, tasks: list[CopyTask],
                    http: httpx.AsyncClient) -> int:
        body = StoreReplicate(keys=[t.key for t in tasks], sizes=[t.size for t in tasks],
                              source=source)
        try:
            reply = await call(http, target.url, STORE_REPLICATE, body, headers=self._headers,
                               timeout=30.0)
        except PeerRefused as exc:
            log.warning("hot-block copy to %s: HTTP %d %s", target.instance_id, exc.status,
                        exc.body[:200])
            return 0
        except CallError as exc:
            log.warning("hot-block copy to %s failed: %r", target.instance_id,
                        exc.__cause__ or exc)
            return 0
        return reply.copied


class MasterCollector(Collector):
    """The index's size and hot-copy counters, read at scrape time."""

    def __init__(self, master: StoreMaster) -> None:
        """Export `master`'s figures."""
        self._master = master

    def collect(self) -> Iterator[Metric]:
        """One scrape."""
        s = self._master.index.stats()
        yield GaugeMetricFamily("mooncake_store_index_keys", "keys in the global store index",
                                value=s.keys)
        tiers = GaugeMetricFamily("mooncake_store_index_replicas",
                                  "copies known to the global index", labels=["tier"])
        for tier, count in s.by_tier.items():
            tiers.add_metric([tier], count)
        yield tiers
        yield CounterMetricFamily("mooncake_store_hot_copies", "hot-block copies made",
                                  value=self._master.copies_made)


async def serve_index_channel(master: StoreMaster, host: str, port: int, public_host: str,
                              secret: str) -> RpcServer:
    """Serve the binary report channel on host:port (0 = any free port) and advertise it."""
    server = RpcServer(master.rpc_handlers(), secret.encode())
    bound = await server.start(host, port)
    master.channel = f"{public_host}:{bound}"
    log.info("store index channel on %s", master.channel)
    return server


def master_router(master: StoreMaster, secret: str,
                  http: httpx.AsyncClient | None = None) -> APIRouter:
    """Routes: INDEX_REPORT, INDEX_LOCATE, INDEX_PLACE, INDEX_PREFIX, INDEX_STATS,
    INDEX_COMMITTED, INDEX_DROP, and INDEX_REUSE when `http` (for hot copies) is given."""
    router = APIRouter(dependencies=[Depends(require_secret(secret))])

    @serve(router, INDEX_REPORT)
    async def report(body: StoreReport) -> StoreReportReply:
        """A store node's snapshot or delta."""
        try:
            return master.report(body)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    @serve(router, INDEX_LOCATE)
    async def locate(body: StoreLocate) -> StoreLocateReply:
        """Where each key's live copies are."""
        return master.locate(body.keys, body.fallback, body.lease)

    @serve(router, INDEX_PLACE)
    async def place(body: StorePlace) -> StorePlaceReply:
        """Where new keys go."""
        return master.place(body.keys, body.replicas, body.preferred, body.skip_existing)

    @serve(router, INDEX_COMMITTED)
    async def committed(body: StoreCommitted) -> dict[str, bool]:
        """A client's keys, committed on a node: indexed now."""
        try:
            master.committed(body)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        return {"ok": True}

    @serve(router, INDEX_DROP)
    async def drop(body: StoreDrop) -> StoreDropReply:
        """Keys a client removes, out of the index (leased ones kept unless force)."""
        try:
            return master.drop(body)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    if http is not None:
        @serve(router, INDEX_REUSE)
        async def reuse(body: StoreKeys) -> dict[str, int]:
            """A conductor's request reuses these keys (hot-block copies)."""
            return {"copies": master.reuse(body.keys, http)}

    @serve(router, INDEX_PREFIX)
    async def prefix(body: StoreKeys) -> StorePrefixReply:
        """Longest cached prefix, overall and per node."""
        return master.prefix(body.keys)

    @serve(router, INDEX_STATS)
    async def index() -> dict[str, object]:
        """Sizes of the index."""
        s = master.index.stats()
        return {"keys": s.keys, "replicas": s.replicas, "by_tier": s.by_tier,
                "by_node": s.by_node}

    return router
