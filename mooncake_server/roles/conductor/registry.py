"""The conductor's instance registry (`InstanceRegistry`) and its routes.

An instance, as the conductor sees it: registered -> alive (a heartbeat at least every
`heartbeat_timeout_s`) -> stale (kept, never picked; a heartbeat revives it) -> forgotten after
`forget_after_s` -> its next heartbeat gets 404 and its Registrar registers again. The same 404
path makes every instance re-register after a conductor restart. An instance that got SIGTERM
says so (POST /internal/drain): draining, it keeps heartbeating and finishing its work but is
never picked again; it deregisters when done (a restart registers it afresh).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, HTTPException

from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import (
    Deregister,
    Drain,
    Heartbeat,
    InstanceInfo,
    InstanceStatus,
)
from mooncake_server.wire.routes import DEREGISTER, DRAIN, HEARTBEAT, INSTANCES, REGISTER, serve

log = logging.getLogger(__name__)

INSTANCE_ROLES = ("prefill", "decode", "store")


@dataclass
class _Entry:
    info: InstanceInfo
    last_seen: float
    load: Heartbeat | None = None
    draining: bool = False


class InstanceRegistry:
    """Live prefill / decode / store instances, with round-robin picking among the alive ones."""

    def __init__(
        self,
        heartbeat_timeout_s: float,
        *,
        forget_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s or 60.0 * heartbeat_timeout_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._next: dict[str, int] = {role: 0 for role in INSTANCE_ROLES}
        self._on_register: list[Callable[[InstanceInfo], None]] = []
        self._on_heartbeat: list[Callable[[Heartbeat], None]] = []
        # NOTE: the sweep for long-silent instances walks every entry, so it runs at most this
        # often, not on every heartbeat (N instances beating each second would cost O(N^2)).
        self._sweep_every_s = min(1.0, self.forget_after_s / 10)
        self._next_sweep = -math.inf

    def on_register(self, listener: Callable[[InstanceInfo], None]) -> None:
        """Call `listener` with every (re-)registration."""
        self._on_register.append(listener)

    def on_heartbeat(self, listener: Callable[[Heartbeat], None]) -> None:
        """Call `listener` with every heartbeat of a known instance, once it is recorded."""
        self._on_heartbeat.append(listener)

    def register(self, info: InstanceInfo) -> None:
        """Add or replace an instance (a restarted instance registers under the same id)."""
        if info.role not in INSTANCE_ROLES:
            raise ValueError(f"role must be one of {', '.join(INSTANCE_ROLES)}, got {info.role!r}")
        if not info.instance_id:
            raise ValueError("instance_id must not be empty")
        old = self._entries.get(info.instance_id)
        self._entries[info.instance_id] = _Entry(info, self._clock())
        log.info("%s %s instance %s at %s", "re-registered" if old else "registered",
                 info.role, info.instance_id, info.url)
        for listener in self._on_register:
            listener(info)

    def heartbeat(self, beat: Heartbeat) -> bool:
        """Record liveness and load; False if the instance is unknown (it must register)."""
        self._forget_stale()
        entry = self._entries.get(beat.instance_id)
        if entry is None:
            return False
        entry.last_seen = self._clock()
        entry.load = beat
        for listener in self._on_heartbeat:
            listener(beat)
        return True

    def deregister(self, instance_id: str) -> bool:
        """Forget an instance now; False if it was unknown."""
        entry = self._entries.pop(instance_id, None)
        if entry is not None:
            log.info("deregistered %s instance %s", entry.info.role, instance_id)
        return entry is not None

    def drain(self, instance_id: str) -> bool:
        """Pick an instance no more while it finishes its work; False if it is unknown."""
        entry = self._entries.get(instance_id)
        if entry is None:
            return False
        if not entry.draining:
            entry.draining = True
            log.info("%s instance %s is draining", entry.info.role, instance_id)
        return True

    def is_alive(self, instance_id: str) -> bool:
        """True while the instance heartbeats (draining or not): its running work goes on."""
        entry = self._entries.get(instance_id)
        return entry is not None and self._is_alive(entry, self._clock())

    def heard_within(self, instance_id: str, seconds: float) -> bool:
        """True if the instance heartbeated in the last `seconds` (registering is no heartbeat)."""
        entry = self._entries.get(instance_id)
        return (entry is not None and entry.load is not None
                and self._clock() - entry.last_seen <= seconds)

    def mark_down(self, instance_id: str) -> None:
        """Stop picking an instance that just failed, until its next heartbeat."""
        entry = self._entries.get(instance_id)
        if entry is not None:
            entry.last_seen = -math.inf
            log.warning("%s instance %s marked down", entry.info.role, instance_id)

    def get(self, instance_id: str) -> InstanceInfo | None:
        """An instance's registration, alive or not."""
        entry = self._entries.get(instance_id)
        return entry.info if entry else None

    def load(self, instance_id: str) -> Heartbeat | None:
        """The latest load report of an instance."""
        entry = self._entries.get(instance_id)
        return entry.load if entry else None

    def _is_alive(self, entry: _Entry, now: float) -> bool:
        return now - entry.last_seen <= self.heartbeat_timeout_s

    def alive(self, role: str) -> list[InstanceInfo]:
        """Alive instances of `role` that take new work (not draining), ordered by id."""
        now = self._clock()
        found = [e.info for e in self._entries.values()
                 if e.info.role == role and not e.draining and self._is_alive(e, now)]
        return sorted(found, key=lambda info: info.instance_id)

    def pick(self, role: str) -> InstanceInfo | None:
        """Next alive instance of `role` in round-robin order, or None when none is alive."""
        candidates = self.alive(role)
        if not candidates:
            return None
        turn = self._next.get(role, 0)
        self._next[role] = turn + 1
        return candidates[turn % len(candidates)]

    def counts(self) -> dict[str, int]:
        """Number of alive instances per role."""
        return {role: len(self.alive(role)) for role in INSTANCE_ROLES}

    def snapshot(self) -> list[InstanceStatus]:
        """Every known instance with its liveness and last load report."""
        now = self._clock()
        return [
            InstanceStatus(
                info=e.info,
                alive=self._is_alive(e, now),
                seconds_since_heartbeat=now - e.last_seen if math.isfinite(e.last_seen) else -1.0,
                load=e.load,
                draining=e.draining,
            )
            for e in sorted(self._entries.values(), key=lambda e: e.info.instance_id)
        ]

    def status(self, instance_id: str) -> InstanceStatus | None:
        """One instance's status."""
        return next((s for s in self.snapshot() if s.info.instance_id == instance_id), None)

    def _forget_stale(self) -> None:
        # Long-silent instances are dropped so the table cannot grow without bound.
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._sweep_every_s
        for instance_id in [i for i, e in self._entries.items()
                            if now - e.last_seen > self.forget_after_s]:
            log.info("forgetting silent instance %s", instance_id)
            del self._entries[instance_id]


def registry_router(registry: InstanceRegistry, secret: str) -> APIRouter:
    """Routes: REGISTER, HEARTBEAT, DRAIN, DEREGISTER, INSTANCES (wire/routes.py)."""
    router = APIRouter(dependencies=[Depends(require_secret(secret))])

    @serve(router, REGISTER)
    async def register(info: InstanceInfo) -> InstanceStatus:
        """Register (or re-register) an instance."""
        try:
            registry.register(info)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        status = registry.status(info.instance_id)
        if status is None:  # NOTE: only if the clock jumped past forget_after_s in between
            raise HTTPException(status_code=503, detail="registration lost; retry")
        return status

    @serve(router, HEARTBEAT)
    async def heartbeat(beat: Heartbeat) -> dict[str, bool]:
        """Liveness + load; 404 tells the instance to register again."""
        if not registry.heartbeat(beat):
            raise HTTPException(status_code=404, detail=f"unknown instance {beat.instance_id}")
        return {"ok": True}

    @serve(router, DRAIN)
    async def drain(body: Drain) -> dict[str, bool]:
        """An instance got SIGTERM: route nothing new to it."""
        return {"ok": registry.drain(body.instance_id)}

    @serve(router, DEREGISTER)
    async def deregister(body: Deregister) -> dict[str, bool]:
        """An instance shutting down gracefully."""
        return {"ok": registry.deregister(body.instance_id)}

    @serve(router, INSTANCES)
    async def instances() -> list[InstanceStatus]:
        """All known instances."""
        return registry.snapshot()

    return router
