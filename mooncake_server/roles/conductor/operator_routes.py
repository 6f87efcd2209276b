"""Operators' view of the request path: requests in flight, ordered moves, and move counters.

POST /internal/migrate orders a decoding request onto another decode instance (load shift);
GET /internal/requests lists what is in flight and where. Both need the cluster secret.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from fastapi import APIRouter, Depends, HTTPException
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncake_server.roles.conductor.moves import MoveStats
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.moves import MigrateReply, MigrateRequest, RunningRequest
from mooncake_server.wire.routes import MIGRATE, REQUESTS, serve


class InFlight(Protocol):
    """What the routes and the collector read of the request path (`RequestPath`)."""

    stats: MoveStats

    def running(self) -> list[RunningRequest]:
        """Requests in flight."""
        ...

    def migrate(self, request_id: str, target: str | None) -> MigrateReply:
        """Order a move; LookupError if unknown, ValueError if it cannot move now."""
        ...


def operator_router(path: Callable[[], InFlight | None], secret: str) -> APIRouter:
    """Routes: POST /internal/migrate, GET /internal/requests (cluster secret required).

    `path()` is the request path, None until the conductor's lifespan has built it.
    """
    router = APIRouter(dependencies=[Depends(require_secret(secret))])

    def current() -> InFlight:
        found = path()
        if found is None:
            raise HTTPException(503, "the conductor is not serving yet")
        return found

    @serve(router, MIGRATE)
    async def migrate(body: MigrateRequest) -> MigrateReply:
        """Move a decoding request to another decode instance (load shift)."""
        try:
            return current().migrate(body.request_id, body.target)
        except LookupError as exc:
            raise HTTPException(404, str(exc)) from None
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from None

    @serve(router, REQUESTS)
    async def requests() -> list[RunningRequest]:
        """Requests in flight and the instance serving each."""
        return current().running()

    return router


class MovesCollector(Collector):
    """Exports the move counters and the number of requests in flight."""

    def __init__(self, path: Callable[[], InFlight | None]) -> None:
        self._path = path

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Samples at scrape time (zeros before the request path exists)."""
        found = self._path()
        stats = found.stats if found is not None else MoveStats()
        for name, what, by_reason in (
                ("mooncake_conductor_decode_moves",
                 "Decoding requests moved to another decode instance", stats.decode_moves),
                ("mooncake_conductor_prefill_resends",
                 "Prefill jobs re-sent to another prefill instance", stats.prefill_resends)):
            family = CounterMetricFamily(name, what, labels=["reason"])
            for reason, n in sorted(by_reason.items()):
                family.add_metric([reason], n)
            yield family
        yield CounterMetricFamily("mooncake_conductor_duplicate_tokens_dropped",
                                  "Tokens a moved request produced again, not passed on",
                                  value=stats.duplicates_dropped)
        yield GaugeMetricFamily("mooncake_conductor_requests_running", "Requests in flight",
                                value=len(found.running()) if found is not None else 0)
