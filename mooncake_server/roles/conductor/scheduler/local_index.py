"""The conductor's view of every prefill instance's local prefix cache.

Each prefill instance reports its cache (`PrefillCacheReport`): a snapshot when it starts or when
asked to resync, then the keys added and evicted after each job. A report from an unknown epoch,
or one that skips a sequence number, is refused with `resync`, so the next one is a snapshot: the
view can lag by one job, never drift. `prefix(instance, keys)` is what the scheduler's prefix
oracle asks per request: the longest leading run of keys that instance holds in its own pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import APIRouter, Depends

from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.jobs import PrefillCacheReport, PrefillCacheReportReply
from mooncake_server.wire.routes import PREFILL_CACHE_INDEX, PREFILL_CACHE_REPORT, serve


@dataclass
class _View:
    epoch: str
    seq: int
    keys: set[str] = field(default_factory=set)


class LocalCacheIndex:
    """Per prefill instance, the set of block keys in its local prefix cache."""

    def __init__(self) -> None:
        self._views: dict[str, _View] = {}

    def apply(self, report: PrefillCacheReport) -> PrefillCacheReportReply:
        """Take a snapshot or a delta; ask for a snapshot when the delta cannot be trusted."""
        view = self._views.get(report.instance_id)
        if report.snapshot:
            self._views[report.instance_id] = _View(report.epoch, report.seq,
                                                    set(report.added) - set(report.removed))
            return PrefillCacheReportReply(accepted=True)
        if view is None or view.epoch != report.epoch or report.seq != view.seq + 1:
            return PrefillCacheReportReply(accepted=False, resync=True)
        view.seq = report.seq
        view.keys.difference_update(report.removed)
        view.keys.update(report.added)
        return PrefillCacheReportReply(accepted=True)

    def prefix(self, instance_id: str, keys: list[str]) -> int:
        """Leading keys the instance holds (0 if it never reported)."""
        view = self._views.get(instance_id)
        if view is None:
            return 0
        n = 0
        for key in keys:
            if key not in view.keys:
                break
            n += 1
        return n

    def sizes(self) -> dict[str, int]:
        """Keys held per reporting instance."""
        return {iid: len(view.keys) for iid, view in self._views.items()}

    def forget(self, instance_id: str) -> None:
        """Drop an instance's view (its next delta then asks for a snapshot)."""
        self._views.pop(instance_id, None)


def local_cache_router(index: LocalCacheIndex, secret: str) -> APIRouter:
    """PREFILL_CACHE_REPORT, PREFILL_CACHE_INDEX (cluster secret required)."""
    router = APIRouter(dependencies=[Depends(require_secret(secret))])

    @serve(router, PREFILL_CACHE_REPORT)
    async def report(body: PrefillCacheReport) -> PrefillCacheReportReply:
        """A prefill instance's cache snapshot or delta."""
        return index.apply(body)

    @serve(router, PREFILL_CACHE_INDEX)
    async def sizes() -> dict[str, int]:
        """Blocks each prefill instance caches, as the conductor sees it."""
        return index.sizes()

    return router
