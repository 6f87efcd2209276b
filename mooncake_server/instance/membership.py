"""This instance's place in the cluster: published in etcd (--etcd) and registered with every
conductor it knows (one `Registrar` each, so each conductor sees its heartbeats and load).

It walks: published (its `InstanceInfo` under a lease) + registered with each named conductor
(awaited, as without etcd) -> conductors found in etcd are joined as they appear, left as they
vanish (one that still answers heartbeats is left only once it stops: etcd ending a lease
after an outage is no conductor gone) -> drain (every conductor is told) -> stop: the lease is
revoked first, so every conductor drops it at once, then each registrar deregisters.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from mooncake_server.config import ServerConfig
from mooncake_server.discovery.conductors import ConductorSet
from mooncake_server.discovery.etcd import EtcdSession, EtcdSettings
from mooncake_server.discovery.leased_key import LeasedKey
from mooncake_server.instance.registrar import Registrar, RegistrationError
from mooncake_server.wire.instances import Heartbeat, InstanceInfo

log = logging.getLogger(__name__)


class Cluster:
    """The etcd session (if any) and conductor set an instance's pieces share."""

    def __init__(self, config: ServerConfig) -> None:
        self.settings = EtcdSettings.from_config(config)
        self.session = EtcdSession(self.settings) if self.settings else None
        if config.role == "store" and config.master_base:
            # A standalone master keeps the registry and index store nodes belong to; the
            # session still publishes this node in etcd, where that master mirrors it from.
            self.conductors = ConductorSet((config.master_base,))
        else:
            self.conductors = ConductorSet(config.conductor_urls, self.session, self.settings)

    async def start(self) -> None:
        """Connect to etcd and learn the conductors (waits up to a lease TTL for a listing)."""
        if self.session is not None and self.settings is not None:
            await self.session.connect()
            await self.conductors.start(wait_s=float(self.settings.lease_ttl_s))

    async def stop(self) -> None:
        """Stop following etcd and close the channel."""
        await self.conductors.stop()
        if self.session is not None:
            await self.session.close()


class Membership:
    """Publishes one instance in etcd and keeps it registered with every conductor."""

    def __init__(self, config: ServerConfig, cluster: Cluster, info: InstanceInfo,
                 load: Callable[[], Heartbeat] | None = None) -> None:
        if info.incarnation is None:  # one per process, the same at every conductor
            info = info.model_copy(update={"incarnation": uuid.uuid4().hex})
        self.info = info
        self._config = config
        self._cluster = cluster
        self._load = load
        self._registrars: dict[str, Registrar] = {}
        self._joining: dict[str, asyncio.Task[None]] = {}
        self._key: LeasedKey | None = None
        if cluster.session is not None and cluster.settings is not None:
            self._key = LeasedKey(cluster.session,
                                  cluster.settings.instance_key(info.role, info.instance_id),
                                  info.model_dump_json().encode(), cluster.settings.lease_ttl_s)

    @property
    def published(self) -> bool:
        """True while etcd holds this instance's key (always False without --etcd)."""
        return self._key is not None and self._key.connected

    def registrar(self, url: str) -> Registrar | None:
        """The registrar talking to conductor `url` (tests, diagnostics)."""
        return self._registrars.get(url)

    async def start(self) -> None:
        """Publish, register with the named conductors (retrying until each answers), then
        follow the conductors etcd names."""
        if self._key is not None:
            await self._key.start()
        named = self._config.conductor_urls
        for url in named:
            registrar = self._new_registrar(url)
            await registrar.start()
        self._cluster.conductors.subscribe(self._added, self._removed)

    def _new_registrar(self, url: str, max_backoff_s: float = 5.0) -> Registrar:
        registrar = Registrar(url, self.info, self._config.cluster_secret,
                              self._config.heartbeat_interval_s, load=self._load,
                              max_backoff_s=max_backoff_s)
        self._registrars[url] = registrar
        return registrar

    def _added(self, url: str) -> None:
        if (known := self._registrars.get(url)) is not None:
            known.leave_when_unreachable(None)  # listed again: kept even if it fails a while
            return
        # NOTE: a conductor publishes itself just before it listens: retry briskly, so it
        # hears from us before the entry etcd gave it goes stale for want of heartbeats.
        registrar = self._new_registrar(url, max_backoff_s=0.5)
        self._joining[url] = asyncio.create_task(self._join(registrar), name=f"join {url}")

    async def _join(self, registrar: Registrar) -> None:
        try:
            await registrar.start()
        except RegistrationError:
            log.exception("conductor %s refused %s", registrar.conductor_url,
                          self.info.instance_id)

    def _removed(self, url: str) -> None:
        registrar = self._registrars.get(url)
        if registrar is not None and registrar.answering:
            # NOTE: its lease ended while it serves (etcd was away longer than the TTL); it
            # publishes again within moments. Silence here meanwhile made it count this
            # instance dead and answer 503.
            log.info("conductor %s left etcd but still answers: kept until it stops", url)
            registrar.leave_when_unreachable(lambda: self._drop(url))
            return
        self._drop(url)

    def _drop(self, url: str) -> None:
        registrar = self._registrars.pop(url, None)
        task = self._joining.pop(url, None)
        if registrar is not None:
            asyncio.create_task(self._leave(registrar, task), name=f"leave {url}")

    async def _leave(self, registrar: Registrar, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await registrar.stop(leaving=False)  # NOTE: that conductor is gone: nobody to tell

    async def drain(self) -> bool:
        """Tell every conductor to send nothing new here; True if any took note."""
        answers = await asyncio.gather(*(r.drain() for r in self._registrars.values()))
        return any(answers)

    async def stop(self) -> None:
        """Leave etcd (now, not after the TTL), then deregister from every conductor."""
        if self._key is not None:
            await self._key.stop()
        for task in self._joining.values():
            task.cancel()
        await asyncio.gather(*self._joining.values(), return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self._registrars.values()))
        self._registrars.clear()
