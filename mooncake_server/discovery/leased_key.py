"""One key kept alive in etcd under this process's lease: present while the process lives.

The key walks: granted (a lease of `ttl`) -> put -> renewed every ttl/3 -> ... If etcd stops
answering, the process carries on (`connected` turns False) and keeps trying; when etcd answers
again, a lease that survived is renewed, one that expired is granted afresh and the key put
again. `stop()` revokes the lease, so the key vanishes at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncake_server.discovery.etcd import EtcdSession, EtcdUnavailable
from mooncake_server.discovery.sealed import seal

log = logging.getLogger(__name__)


class LeasedKey:
    """Keeps `key` = `value` in etcd under a lease of `ttl_s` for as long as it runs."""

    def __init__(self, session: EtcdSession, key: str, value: bytes, ttl_s: int) -> None:
        """`value` is stored sealed with the cluster secret (sealed.py)."""
        self._session = session
        self.key = key
        self._value = seal(session.settings.secret, key, value)
        self._ttl_s = ttl_s
        self._lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._published = asyncio.Event()
        self.connected = False
        self.last_ok = float("-inf")  # time.monotonic() of etcd's last answer
        self.grants = 0  # leases granted so far (> 1: etcd lost one and the key was re-made)

    async def start(self) -> None:
        """Keep the key alive in the background (etcd down at start is not an error)."""
        self._task = asyncio.create_task(self._run(), name=f"etcd-lease {self.key}")

    async def wait_published(self, timeout_s: float) -> bool:
        """Wait until the key was put once; False if it was not within `timeout_s`."""
        try:
            await asyncio.wait_for(self._published.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Stop renewing and revoke the lease (best effort): the key disappears now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._lease is not None:
            try:
                await self._session.revoke(self._lease)
            except EtcdUnavailable as exc:
                log.debug("revoking the lease of %s failed: %s", self.key, exc)
            self._lease = None

    async def _publish(self) -> None:
        self._lease = await self._session.grant(self._ttl_s)
        self.grants += 1
        await self._session.put(self.key, self._value, self._lease)
        self._published.set()
        log.info("published %s in etcd (lease %x, ttl %ds)", self.key, self._lease, self._ttl_s)

    async def _run(self) -> None:
        period = self._ttl_s / 3
        delay = 0.1
        while True:
            try:
                if self._lease is None:
                    await self._publish()
                elif await self._session.keep_alive(self._lease) <= 0:
                    log.warning("etcd lease of %s expired; publishing it again", self.key)
                    self._lease = None
                    continue
                if not self.connected:
                    log.info("etcd reachable: %s is held", self.key)
                self.connected, self.last_ok, delay = True, time.monotonic(), 0.1
                await asyncio.sleep(period)
            except EtcdUnavailable as exc:
                if self.connected or self.last_ok == float("-inf"):
                    log.warning("etcd unreachable (%s); %s kept trying", exc, self.key)
                self.connected = False
                if self.last_ok == float("-inf"):
                    self.last_ok = time.monotonic()  # NOTE: counts down from the first try
                await asyncio.sleep(delay)
                delay = min(2 * delay, period)
