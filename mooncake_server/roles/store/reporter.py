"""A store node's report stream to the global index in the conductor.

The stream walks: snapshot (everything the node holds, on start) -> deltas (the latest tier of
each changed key, coalesced, one POST in flight at a time) -> ... A delta the master refuses
(it restarted, or forgot the node) triggers a new snapshot. While idle, an empty delta every
`keepalive_s` lets a restarted conductor ask for that snapshot. Entries are states, not events,
so re-sending after a failed POST is harmless. Once an answer names the index's binary channel,
reports go there (one frame each, no HTTP request on either side); if the channel fails, reports
go over HTTP for `channel_retry_s`, then the channel is dialled again (an address this node
cannot reach costs one failed call per period, not one per report). `IndexReporters` runs one
such stream per conductor (several conductors, each with its own index).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

import httpx

from mooncake_server.discovery.conductors import ConductorSet
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.index import IndexOp, StoreEntry, StoreReport, StoreReportReply
from mooncake_server.wire.routes import INDEX_REPORT, CallError, call
from mooncake_server.wire.rpc import RpcClient, RpcError

logger = logging.getLogger(__name__)


class IndexReporter:
    """Sends one node's snapshot and deltas to the index (INDEX_REPORT, or its channel)."""

    def __init__(self, master_url: str, node_id: str, secret: str,
                 snapshot: Callable[[], list[StoreEntry]], *, keepalive_s: float = 2.0,
                 coalesce_s: float = 0.02, http: httpx.AsyncClient | None = None,
                 channel_retry_s: float = 30.0) -> None:
        """`snapshot()` returns everything the node holds, synchronously (a consistent cut)."""
        self._master = master_url
        self.node_id = node_id
        self.epoch = uuid.uuid4().hex
        self._headers = secret_headers(secret)
        self._secret = secret.encode()
        self._channel: RpcClient | None = None
        self._channel_retry_s = channel_retry_s
        self._channel_down_until = float("-inf")
        self._snapshot = snapshot
        self._keepalive_s = keepalive_s
        self._coalesce_s = coalesce_s
        self._http = http
        self._own_http = http is None
        self._pending: dict[str, StoreEntry] = {}
        self._wake = asyncio.Event()
        self._need_snapshot = True
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._inflight = False
        self.reports_sent = 0
        self.reports_on_channel = 0

    def changed(self, entry: StoreEntry) -> None:
        """Queue a key's new state (newest wins) and wake the sender."""
        self._pending[entry.key] = entry
        self._wake.set()

    async def start(self) -> None:
        """Start sending in the background (the first report is a snapshot)."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0))
        self._wake.set()  # the snapshot goes out at once
        self._task = asyncio.create_task(self._run(), name=f"index-reporter-{self.node_id}")

    async def stop(self) -> None:
        """Stop sending (pending deltas are dropped: the next start sends a snapshot)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._channel is not None:
            await self._channel.aclose()
            self._channel = None
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything queued so far was accepted (tests, graceful paths)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._pending or self._need_snapshot or self._inflight:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"index reports of {self.node_id} not accepted in time")
            await asyncio.sleep(0.005)

    async def _run(self) -> None:
        delay = 0.05
        loop = asyncio.get_running_loop()
        while True:
            # NOTE: a timer setting the event, not asyncio.wait_for, whose 3.10/3.11 versions can
            # swallow a cancellation that races the wake-up (the task then never stops).
            timer = loop.call_later(self._keepalive_s, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
            self._wake.clear()
            if not self._need_snapshot and self._coalesce_s > 0:
                # NOTE: one report per burst of puts, not one per put: each POST costs this
                # node's event loop ~1 ms that its readers would otherwise wait behind.
                await asyncio.sleep(self._coalesce_s)
            try:
                await self._send_once()
                delay = 0.05
            except (CallError, httpx.HTTPError, ValueError) as exc:
                logger.warning("reporting to the store index failed (%s); retrying", exc)
                self._need_snapshot = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                self._wake.set()

    async def _send_once(self) -> None:
        self._inflight = True
        try:
            if self._need_snapshot:
                # NOTE: taken synchronously with clearing the queue, so no change falls between.
                entries = self._snapshot()
                self._pending.clear()
                self._seq += 1
                report = StoreReport(node_id=self.node_id, epoch=self.epoch, seq=self._seq,
                                     snapshot=True, entries=entries)
            else:
                entries = list(self._pending.values())
                self._pending.clear()
                self._seq += 1
                report = StoreReport(node_id=self.node_id, epoch=self.epoch, seq=self._seq,
                                     entries=entries)
            try:
                reply = await self._post(report)
            except BaseException:
                if not report.snapshot:
                    for e in entries:  # put them back, unless something newer arrived
                        self._pending.setdefault(e.key, e)
                raise
            self.reports_sent += 1
            if report.snapshot:
                self._need_snapshot = not reply.accepted
            elif reply.resync:
                logger.info("store index asked %s for a full snapshot", self.node_id)
                self._need_snapshot = True
                self._wake.set()
        finally:
            self._inflight = False

    async def _post(self, report: StoreReport) -> StoreReportReply:
        if self._http is None:
            raise RuntimeError("IndexReporter.start() must be called first")
        payload = report.model_dump_json()
        if self._channel is not None:
            try:
                answer = await self._channel.call(IndexOp.REPORT, payload.encode())
                self.reports_on_channel += 1
                return StoreReportReply.model_validate_json(answer)
            except RpcError as exc:  # a restarted conductor, a new port: HTTP finds it again
                logger.info("index channel %s failed (%s); reporting over HTTP",
                            self._channel.address, exc)
                await self._channel.aclose()
                self._channel = None
                self._channel_down_until = asyncio.get_running_loop().time() + \
                    self._channel_retry_s
        reply = await call(self._http, self._master, INDEX_REPORT, report, headers=self._headers)
        if (reply.channel and self._channel is None
                and asyncio.get_running_loop().time() >= self._channel_down_until):
            self._channel = RpcClient(reply.channel, self._secret, self._http.timeout.read)
        return reply


class IndexReporters:
    """One `IndexReporter` per conductor of `conductors`: every conductor keeps its own index,
    so each gets this node's snapshot and every delta."""

    def __init__(self, conductors: ConductorSet, node_id: str, secret: str,
                 snapshot: Callable[[], list[StoreEntry]]) -> None:
        self._conductors = conductors
        self._make = lambda url: IndexReporter(url, node_id, secret, snapshot)
        self._reporters: dict[str, IndexReporter] = {}
        self._moves: set[asyncio.Task[None]] = set()

    @property
    def reports_sent(self) -> int:
        """Reports accepted so far, over all conductors."""
        return sum(r.reports_sent for r in self._reporters.values())

    def reporter(self, url: str) -> IndexReporter | None:
        """The reporter sending to conductor `url`."""
        return self._reporters.get(url)

    def changed(self, entry: StoreEntry) -> None:
        """Queue a key's new state for every conductor."""
        for reporter in self._reporters.values():
            reporter.changed(entry)

    async def start(self) -> None:
        """Report to every conductor known now, and to each one that joins later."""
        self._conductors.subscribe(self._added, self._removed)

    def _added(self, url: str) -> None:
        if url not in self._reporters:
            reporter = self._reporters[url] = self._make(url)
            self._track(reporter.start())

    def _removed(self, url: str) -> None:
        reporter = self._reporters.pop(url, None)
        if reporter is not None:
            self._track(reporter.stop())

    def _track(self, step: Awaitable[None]) -> None:
        task = asyncio.ensure_future(step)
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every conductor accepted everything queued so far."""
        await asyncio.gather(*(r.flush(timeout_s) for r in list(self._reporters.values())))

    async def stop(self) -> None:
        """Stop reporting everywhere."""
        await asyncio.gather(*list(self._moves), return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self._reporters.values()))
        self._reporters.clear()
