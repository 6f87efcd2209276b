"""The HTTP app every instance role (prefill, decode, store, colocated) starts from.

Its lifespan walks: the role's `start` hook (which builds what the role runs, pushing each piece's
clean-up on the exit stack as it goes, and calls `Starting.join` to register with the conductor)
-> serving -> the exit stack unwinds in reverse: deregistration first (pushed last), then the
role's own pieces, the transfer engine last. `join` also installs the SIGTERM drain
(instance/drain.py): tell the conductors to send nothing new, then wait while the role is busy.
`cluster()` is what the role's pieces share to find conductors: --conductor-url, plus with
--etcd every conductor etcd names (instance/membership.py).
Every instance answers GET /health (liveness, open) and GET /metrics (its Prometheus registry).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry

from mooncake_server.config import ServerConfig
from mooncake_server.instance.drain import wait_until_idle
from mooncake_server.instance.membership import Cluster, Membership
from mooncake_server.wire.auth import metrics_response
from mooncake_server.wire.instances import Heartbeat, InstanceInfo

log = logging.getLogger(__name__)


@dataclass
class Starting:
    """What a role's start hook builds on: its config, the app and the lifespan's exit stack."""

    config: ServerConfig
    app: FastAPI
    stack: AsyncExitStack
    _cluster: Cluster | None = field(default=None, repr=False)

    async def cluster(self) -> Cluster:
        """The conductors (and etcd session) of this instance, started on first use and
        stopped at shutdown."""
        if self._cluster is None:
            self._cluster = Cluster(self.config)
            await self._cluster.start()
            self.stack.push_async_callback(self._cluster.stop)
        return self._cluster

    async def join(self, info: InstanceInfo, busy: Callable[[], bool], what: str,
                   load: Callable[[], Heartbeat] | None = None) -> Membership:
        """Publish in etcd (--etcd) and register with the conductors (heartbeats carry
        `load()`), leave at shutdown, and drain on SIGTERM until `busy()` is False (at most
        --drain-timeout; `what` names it)."""
        config = self.config
        membership = Membership(config, await self.cluster(), info, load=load)
        await membership.start()
        self.stack.push_async_callback(membership.stop)

        async def drain() -> None:
            await membership.drain()
            await wait_until_idle(busy, config.drain_timeout_s, what)

        self.app.state.drain = drain
        return membership


StartHook = Callable[[Starting], Awaitable[None]]
HealthHook = Callable[[], dict[str, Any]]


def _alive() -> dict[str, Any]:
    return {"status": "ok"}


def instance_app(config: ServerConfig, title: str, metrics: CollectorRegistry, start: StartHook,
                 *, status: HealthHook = _alive) -> FastAPI:
    """An instance's FastAPI app: `start` runs in the lifespan, /health and /metrics are served;
    the role adds its own routes to what this returns."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            await start(Starting(config, app, stack))
            yield

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.drain = None  # set by Starting.join; SIGTERM runs it before shutting down

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness."""
        return status()

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """Prometheus metrics."""
        return metrics_response(metrics)

    return app
