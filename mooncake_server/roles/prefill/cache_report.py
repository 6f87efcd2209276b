"""A prefill instance's reports of its local prefix cache to the conductor.

The stream walks: snapshot (on the first report, and whenever the conductor answers `resync`)
-> deltas (keys added and evicted since the last accepted report) -> ... Changes a report could
not deliver are kept for the next one, so a failed POST delays the view, never corrupts it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import httpx

from mooncake_server.roles.prefill.prefix_cache import LocalPrefixCache
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.jobs import PrefillCacheReport
from mooncake_server.wire.routes import PREFILL_CACHE_REPORT, CallError, call_at

log = logging.getLogger(__name__)


class CacheReporter:
    """Posts one instance's cache changes to the conductor (PREFILL_CACHE_REPORT)."""

    def __init__(self, conductor_url: str | Callable[[], str], instance_id: str, secret: str,
                 cache: LocalPrefixCache, http: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
        """`conductor_url`: where reports go (a callable: the conductor to report to now)."""
        self._conductor = conductor_url if callable(conductor_url) else (lambda: conductor_url)
        self._headers = secret_headers(secret)
        self.instance_id = instance_id
        self.epoch = uuid.uuid4().hex
        self._cache = cache
        self._http = http
        self._timeout = timeout_s
        self._seq = 0
        self._need_snapshot = True

    async def flush(self) -> bool:
        """Send what changed (or a snapshot); True when the conductor took it."""
        added, removed = self._cache.take_changes()
        snapshot = self._need_snapshot
        if snapshot:
            added, removed = self._cache.keys(), []
        elif not added and not removed:
            return True
        report = PrefillCacheReport(instance_id=self.instance_id, epoch=self.epoch,
                                    seq=self._seq + 1, snapshot=snapshot, added=added,
                                    removed=removed)
        try:
            url = PREFILL_CACHE_REPORT.url(self._conductor())
            reply = await call_at(self._http, url, PREFILL_CACHE_REPORT, report,
                                  headers=self._headers, timeout=self._timeout)
        except CallError as exc:
            log.warning("prefix cache report failed (kept for the next one): %r", exc)
            if not snapshot:
                self._cache.restore_changes(added, removed)
            return False
        if reply.accepted:
            self._seq += 1
            self._need_snapshot = False
            return True
        # The conductor lost track (it restarted, or missed a report): resend everything.
        self._need_snapshot = True
        return await self.flush() if reply.resync and not snapshot else False
