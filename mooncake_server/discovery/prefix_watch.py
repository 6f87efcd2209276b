"""Following every key under an etcd prefix: list once, then watch from the next revision.

The view walks: listed (`on_sync(all items)`) -> watched (`on_put` / `on_delete` per change)
-> ... If the watch ends (a compacted revision) or etcd fails, the view is kept as it is and
the prefix is listed again once etcd answers, so a change missed meanwhile is caught by the next
`on_sync`. Callbacks run on the event loop and must not block. They see only values sealed
with the cluster secret (sealed.py), unsealed; any other value counts as no key at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mooncake_server.discovery.etcd import PUT, EtcdSession, EtcdUnavailable
from mooncake_server.discovery.sealed import unseal

log = logging.getLogger(__name__)


class PrefixWatch:
    """Calls `on_sync`, `on_put` and `on_delete` as the keys under `prefix` change."""

    def __init__(self, session: EtcdSession, prefix: str, *,
                 on_sync: Callable[[dict[str, bytes]], None],
                 on_put: Callable[[str, bytes], None],
                 on_delete: Callable[[str], None], retry_s: float = 0.5) -> None:
        self._session = session
        self.prefix = prefix
        self._on_sync, self._on_put, self._on_delete = on_sync, on_put, on_delete
        self._retry_s = retry_s
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self.syncs = 0  # full listings applied so far

    async def start(self) -> None:
        """Follow the prefix in the background."""
        self._task = asyncio.create_task(self._run(), name=f"etcd-watch {self.prefix}")

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait for the first listing; False if etcd gave none within `timeout_s`."""
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Stop following."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _unseal(self, key: str, raw: bytes) -> bytes | None:
        value = unseal(self._session.settings.secret, key, raw)
        if value is None:
            log.warning("ignoring etcd key %s: not sealed with this cluster's secret", key)
        return value

    async def _run(self) -> None:
        while True:
            try:
                listing = await self._session.list(self.prefix)
            except EtcdUnavailable as exc:
                log.debug("listing %s failed: %s", self.prefix, exc)
                await asyncio.sleep(self._retry_s)
                continue
            self._on_sync({k: v for k, raw in listing.items.items()
                           if (v := self._unseal(k, raw)) is not None})
            self.syncs += 1
            self._synced.set()
            try:
                async for batch in self._session.watch(self.prefix, listing.revision + 1):
                    for event in batch:
                        value = self._unseal(event.key, event.value) if event.kind == PUT \
                            else None
                        if value is not None:
                            self._on_put(event.key, value)
                        else:
                            self._on_delete(event.key)
            except EtcdUnavailable as exc:
                log.warning("watch of %s failed (%s); listing it again", self.prefix, exc)
            await asyncio.sleep(self._retry_s)
