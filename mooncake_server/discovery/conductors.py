"""Which conductors an instance joins: those named by --conductor-url, plus (with --etcd) every
conductor published under `conductors/`.

A conductor, as an instance sees it: appears (listeners' `added(url)`: register, heartbeat,
report to it) -> vanishes from etcd (`removed(url)`: stop talking to it). Named conductors never
vanish. While etcd is unreachable the set stays as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pydantic import ValidationError

from mooncake_server.discovery.etcd import EtcdSession, EtcdSettings
from mooncake_server.discovery.prefix_watch import PrefixWatch
from mooncake_server.wire.instances import ConductorInfo

log = logging.getLogger(__name__)

Listener = Callable[[str], None]


class ConductorSet:
    """The conductors this instance talks to, with listeners told of each one joining or leaving."""

    def __init__(self, named: tuple[str, ...], session: EtcdSession | None = None,
                 settings: EtcdSettings | None = None) -> None:
        self._named = tuple(u.rstrip("/") for u in named)
        self._found: dict[str, str] = {}  # etcd key -> url
        self._added: list[Listener] = []
        self._removed: list[Listener] = []
        self._watch = None
        if session is not None and settings is not None:
            self._watch = PrefixWatch(session, settings.conductors_prefix, on_sync=self._sync,
                                      on_put=self._put, on_delete=self._delete)

    def urls(self) -> list[str]:
        """Every conductor now: named ones first, then those found in etcd (sorted)."""
        found = sorted(set(self._found.values()) - set(self._named))
        return [*self._named, *found]

    def current(self) -> str:
        """One conductor to ask (store index lookups, cache reports): the first of `urls()`,
        or "" while none is known."""
        urls = self.urls()
        return urls[0] if urls else ""

    def subscribe(self, added: Listener, removed: Listener) -> None:
        """Call `added(url)` for each conductor now and later, `removed(url)` as they leave."""
        self._added.append(added)
        self._removed.append(removed)
        for url in self.urls():
            added(url)

    async def start(self, wait_s: float = 0.0) -> None:
        """Follow etcd's conductors (if configured); wait up to `wait_s` for the first listing."""
        if self._watch is not None:
            await self._watch.start()
            if wait_s > 0:
                await self._watch.wait_synced(wait_s)

    async def stop(self) -> None:
        """Stop following etcd."""
        if self._watch is not None:
            await self._watch.stop()

    def _apply(self, found: dict[str, str]) -> None:
        before = set(self.urls())
        self._found = found
        after = set(self.urls())
        for url in sorted(after - before):
            log.info("conductor %s joined", url)
            for listener in self._added:
                listener(url)
        for url in sorted(before - after):
            log.info("conductor %s left", url)
            for listener in self._removed:
                listener(url)

    def _parse(self, key: str, value: bytes) -> str | None:
        try:
            return ConductorInfo.model_validate_json(value).url.rstrip("/")
        except ValidationError as exc:
            log.warning("ignoring etcd key %s: not a ConductorInfo (%s)", key, exc)
            return None

    def _sync(self, items: dict[str, bytes]) -> None:
        found = {k: url for k, v in items.items() if (url := self._parse(k, v)) is not None}
        self._apply(found)

    def _put(self, key: str, value: bytes) -> None:
        url = self._parse(key, value)
        if url is not None:
            self._apply({**self._found, key: url})

    def _delete(self, key: str) -> None:
        self._apply({k: u for k, u in self._found.items() if k != key})
