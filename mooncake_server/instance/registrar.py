"""An instance's registration with the conductor: register, heartbeat, re-register, drain, leave.

The conductor's side is `roles/conductor/registry.py`; a 404 on a heartbeat (the conductor
restarted or forgot this instance) makes the `Registrar` register again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import BaseModel

from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.instances import Deregister, Drain, Heartbeat, InstanceInfo
from mooncake_server.wire.routes import (
    DEREGISTER,
    DRAIN,
    HEARTBEAT,
    REGISTER,
    CallError,
    PeerRefused,
    PeerUnreachable,
    Route,
    send,
)

log = logging.getLogger(__name__)


class RegistrationError(RuntimeError):
    """The conductor refused the registration (wrong secret, invalid info): retrying won't help."""


class Registrar:
    """Keeps one instance registered with the conductor: register, heartbeat, re-register."""

    def __init__(
        self,
        conductor_url: str,
        info: InstanceInfo,
        secret: str,
        interval_s: float,
        load: Callable[[], Heartbeat] | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        max_backoff_s: float = 5.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval_s}")
        self.conductor_url = conductor_url.rstrip("/")
        if info.incarnation is None:  # one per process: a Registrar lives as long as its role
            info = info.model_copy(update={"incarnation": uuid.uuid4().hex})
        self.info = info
        self.interval_s = interval_s
        self.registrations = 0  # successful registrations so far (re-registrations included)
        self._headers = secret_headers(secret)
        self._load = load
        self._http = http
        self._own_http = http is None
        self._max_backoff_s = max_backoff_s
        self._task: asyncio.Task[None] | None = None
        # False from a heartbeat that found no conductor until one is answered again.
        self.answering = False
        self._on_unreachable: Callable[[], None] | None = None

    async def start(self) -> None:
        """Register (retrying with backoff until the conductor answers), then heartbeat."""
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(max(2.0, 2 * self.interval_s), connect=2.0))
        await self._register_until_ok()
        try:
            # The load goes along at once: the conductor judges this instance by it from its
            # first request (a decode's calibration; without it, the bare cost model refused
            # an idle cluster's first requests).
            await self._send(HEARTBEAT, self._current_load())
        except (PeerUnreachable, PeerRefused) as exc:
            log.debug("first heartbeat of %s: %s", self.info.instance_id, exc)
        self._task = asyncio.create_task(
            self._heartbeat_forever(), name=f"heartbeat-{self.info.instance_id}")

    async def stop(self, *, leaving: bool = True) -> None:
        """Stop heartbeating and tell the conductor we are leaving (best effort; `leaving`
        False: say nothing, e.g. to a conductor that is gone)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._http is None:
            return
        if leaving:
            try:
                await send(self._http, self.conductor_url, DEREGISTER,
                           Deregister(instance_id=self.info.instance_id), headers=self._headers,
                           timeout=1.0)
            except CallError as exc:
                log.debug("deregistration of %s failed: %s", self.info.instance_id, exc)
        if self._own_http:
            await self._http.aclose()
            self._http = None

    def leave_when_unreachable(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once, at the next heartbeat that finds no conductor (None: never)."""
        self._on_unreachable = callback

    async def drain(self) -> bool:
        """Tell the conductor to send nothing new here (SIGTERM); heartbeats go on."""
        if self._http is None:
            return False
        try:
            await send(self._http, self.conductor_url, DRAIN,
                       Drain(instance_id=self.info.instance_id), headers=self._headers,
                       timeout=2.0)
        except PeerRefused:
            return False
        except CallError as exc:
            log.warning("drain notice of %s failed: %s", self.info.instance_id, exc)
            return False
        return True

    async def _send(self, route: Route[Any, Any], body: BaseModel) -> None:
        # NOTE: only success matters here: a conductor's reply carries nothing we keep.
        if self._http is None:
            raise RuntimeError("Registrar.start() must be called first")
        await send(self._http, self.conductor_url, route, body, headers=self._headers)

    async def _register_until_ok(self) -> None:
        delay = 0.1
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._send(REGISTER, self.info)
            except PeerUnreachable as exc:
                cause = exc.__cause__
                problem = f"conductor unreachable ({type(cause).__name__}: {cause})"
            except PeerRefused as exc:
                if exc.status in (400, 401, 403, 422):
                    raise RegistrationError(
                        f"conductor {self.conductor_url} refused {self.info.instance_id}: "
                        f"HTTP {exc.status} {exc.body}") from None
                problem = f"HTTP {exc.status}"
            else:
                self.registrations += 1
                self.answering = True
                log.info("registered %s %s with %s", self.info.role, self.info.instance_id,
                         self.conductor_url)
                return
            # One warning, then quiet retries: a conductor starting late is normal.
            (log.warning if attempt == 1 else log.debug)(
                "registering %s: %s; retrying", self.info.instance_id, problem)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self._max_backoff_s)

    def _current_load(self) -> Heartbeat:
        if self._load is not None:
            try:
                beat = self._load()
                return beat.model_copy(update={"instance_id": self.info.instance_id})
            except Exception:
                log.exception("load report of %s failed; sending a bare heartbeat",
                              self.info.instance_id)
        return Heartbeat(instance_id=self.info.instance_id)

    async def _heartbeat_forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._send(HEARTBEAT, self._current_load())
                status = 200
            except PeerUnreachable as exc:
                if not failing:
                    log.warning("heartbeat of %s failed: %s", self.info.instance_id,
                                exc.__cause__)
                failing, self.answering = True, False
                if (leave := self._on_unreachable) is not None:
                    self._on_unreachable = None  # once: it stops this registrar
                    leave()
                continue
            except PeerRefused as exc:
                status = exc.status or 0
            self.answering = True
            if failing:
                log.info("heartbeat of %s recovered", self.info.instance_id)
                failing = False
            if status == 404:
                log.info("conductor does not know %s (restarted?); registering again",
                         self.info.instance_id)
                try:
                    await self._register_until_ok()
                except RegistrationError:
                    log.exception("re-registration refused; heartbeats stop")
                    return
            elif status != 200:
                log.warning("heartbeat of %s: HTTP %d", self.info.instance_id, status)
