"""A conductor's side of etcd discovery: publish itself, feed the instances into its registry.

An instance, as this feed sees it: its key appears (register; it is alive from that moment,
before its first heartbeat here) -> changes (register again) -> vanishes (lease expired or
revoked: deregister at once, so requests leave it without waiting for missed heartbeats).
Liveness and load between those events still come from the instance's heartbeats, as without
etcd. While etcd is unreachable the registry keeps the view it has and heartbeats keep it
current; `/health` and `mooncake_conductor_etcd_connected` say so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from mooncake_server.discovery.etcd import EtcdSession, EtcdSettings
from mooncake_server.discovery.leased_key import LeasedKey
from mooncake_server.discovery.prefix_watch import PrefixWatch
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.wire.instances import ConductorInfo, InstanceInfo

log = logging.getLogger(__name__)

# Two heartbeats at the default --heartbeat-interval: an instance heard this recently is alive.
STILL_HEARD_S = 2.0


class RegistryFeed:
    """Publishes this conductor under `conductors/` and mirrors `instances/` into `registry`."""

    def __init__(self, settings: EtcdSettings, registry: InstanceRegistry,
                 me: ConductorInfo, own_key: str | None = None) -> None:
        """Publish `me` under `own_key` (default: its conductor key; a standalone store master
        passes its own, so instances do not take it for a conductor)."""
        self._session = EtcdSession(settings)
        self._registry = registry
        self._settings = settings
        self._own = LeasedKey(self._session, own_key or settings.conductor_key(me.conductor_id),
                              me.model_dump_json().encode(), settings.lease_ttl_s)
        self._watch = PrefixWatch(self._session, settings.instances_prefix,
                                  on_sync=self._sync, on_put=self._put, on_delete=self._delete)
        self._from_etcd: set[str] = set()  # ids this feed registered (only these it removes)

    @property
    def connected(self) -> bool:
        """True while etcd renews this conductor's lease."""
        return self._own.connected

    async def start(self) -> None:
        """Connect and follow etcd in the background; waits briefly for the first listing, so a
        (re)started conductor knows its instances before it serves."""
        await self._session.connect()
        await self._own.start()
        await self._watch.start()
        wait_s = self._settings.lease_ttl_s
        if not await self._watch.wait_synced(wait_s) or not await self._own.wait_published(0.5):
            log.warning("etcd not answering yet; serving what registers over HTTP meanwhile")

    async def stop(self) -> None:
        """Stop following, leave etcd (our key goes now), close the channel."""
        await self._watch.stop()
        await self._own.stop()
        await self._session.close()

    def _parse(self, key: str, value: bytes) -> InstanceInfo | None:
        try:
            return InstanceInfo.model_validate_json(value)
        except ValidationError as exc:
            log.warning("ignoring etcd key %s: not an InstanceInfo (%s)", key, exc)
            return None

    def _put(self, key: str, value: bytes) -> None:
        info = self._parse(key, value)
        if info is None:
            return
        if self._registry.get(info.instance_id) == info:
            self._from_etcd.add(info.instance_id)
            return  # already known as it is (e.g. registered over HTTP first)
        try:
            self._registry.register(info)
        except ValueError as exc:
            log.warning("ignoring etcd key %s: %s", key, exc)
            return
        self._from_etcd.add(info.instance_id)

    def _delete(self, key: str) -> None:
        self._forget(key.rsplit("/", 1)[-1])

    def _forget(self, instance_id: str) -> None:
        """The instance's key is gone: drop it, unless it is still heartbeating to us.

        A lease also ends when etcd was away longer than its TTL, while the instance ran on; it
        makes a new one as soon as etcd is back, and meanwhile its heartbeats say it is alive
        (dropping it made every request 503 for that moment). A killed instance has been
        silent for most of a TTL by the time its lease ends, and goes at once.
        """
        if instance_id not in self._from_etcd:
            return
        self._from_etcd.discard(instance_id)
        if self._registry.heard_within(instance_id, STILL_HEARD_S):
            log.info("instance %s left etcd but still heartbeats: kept", instance_id)
            return
        self._registry.deregister(instance_id)

    def _sync(self, items: dict[str, bytes]) -> None:
        seen = set()
        for key, value in items.items():
            self._put(key, value)
            seen.add(key.rsplit("/", 1)[-1])
        for gone in sorted(self._from_etcd - seen):
            log.info("instance %s left etcd while the watch was down", gone)
            self._forget(gone)


class EtcdCollector(Collector):
    """Exports whether this conductor reaches etcd (1) or serves from the view it has (0)."""

    def __init__(self, feed: RegistryFeed) -> None:
        self._feed = feed

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One gauge."""
        yield GaugeMetricFamily("mooncake_conductor_etcd_connected",
                                "1 while etcd renews this conductor's lease, else 0",
                                value=1.0 if self._feed.connected else 0.0)
