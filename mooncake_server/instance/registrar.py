"""An instance's registration with the conductor: register, heartbeat, re-register, drain, leave.

The conductor's side is `roles/conductor/registry.py`; a 404 on a heartbeat (the conductor
restarted or forgot this instance) makes the `Registrar` register again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import httpx

from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.instances import Deregister, Drain, Heartbeat, InstanceInfo

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

    async def start(self) -> None:
        """Register (retrying with backoff until the conductor answers), then heartbeat."""
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(max(2.0, 2 * self.interval_s), connect=2.0))
        await self._register_until_ok()
        self._task = asyncio.create_task(
            self._heartbeat_forever(), name=f"heartbeat-{self.info.instance_id}")

    async def stop(self) -> None:
        """Stop heartbeating and tell the conductor we are leaving (best effort)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._http is None:
            return
        try:
            await self._http.post(
                f"{self.conductor_url}/internal/deregister", headers=self._headers, timeout=1.0,
                json=Deregister(instance_id=self.info.instance_id).model_dump(mode="json"))
        except httpx.HTTPError as exc:
            log.debug("deregistration of %s failed: %s", self.info.instance_id, exc)
        if self._own_http:
            await self._http.aclose()
            self._http = None

    async def drain(self) -> bool:
        """Tell the conductor to send nothing new here (SIGTERM); heartbeats go on."""
        if self._http is None:
            return False
        try:
            r = await self._http.post(
                f"{self.conductor_url}/internal/drain", headers=self._headers, timeout=2.0,
                json=Drain(instance_id=self.info.instance_id).model_dump(mode="json"))
        except httpx.HTTPError as exc:
            log.warning("drain notice of %s failed: %s", self.info.instance_id, exc)
            return False
        return r.is_success

    async def _post(self, path: str, body: dict[str, object]) -> httpx.Response:
        if self._http is None:
            raise RuntimeError("Registrar.start() must be called first")
        return await self._http.post(f"{self.conductor_url}{path}", json=body,
                                     headers=self._headers)

    async def _register_until_ok(self) -> None:
        delay = 0.1
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await self._post("/internal/register", self.info.model_dump(mode="json"))
            except httpx.TransportError as exc:
                problem = f"conductor unreachable ({type(exc).__name__}: {exc})"
            else:
                if r.is_success:
                    self.registrations += 1
                    log.info("registered %s %s with %s", self.info.role, self.info.instance_id,
                             self.conductor_url)
                    return
                if r.status_code in (400, 401, 403, 422):
                    raise RegistrationError(
                        f"conductor {self.conductor_url} refused {self.info.instance_id}: "
                        f"HTTP {r.status_code} {r.text[:300]}")
                problem = f"HTTP {r.status_code}"
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
                r = await self._post("/internal/heartbeat", self._current_load().model_dump())
            except httpx.TransportError as exc:
                if not failing:
                    log.warning("heartbeat of %s failed: %s", self.info.instance_id, exc)
                failing = True
                continue
            if failing:
                log.info("heartbeat of %s recovered", self.info.instance_id)
                failing = False
            if r.status_code == 404:
                log.info("conductor does not know %s (restarted?); registering again",
                         self.info.instance_id)
                try:
                    await self._register_until_ok()
                except RegistrationError:
                    log.exception("re-registration refused; heartbeats stop")
                    return
            elif not r.is_success:
                log.warning("heartbeat of %s: HTTP %d", self.info.instance_id, r.status_code)
