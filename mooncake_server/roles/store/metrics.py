"""Prometheus view of one store node, read from its counters at scrape time (one source of truth)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake_server.roles.store.node import StoreNode


def _by_tier(name: str, doc: str, kind: type[GaugeMetricFamily | CounterMetricFamily],
             dram: float, ssd: float) -> Metric:
    family = kind(name, doc, labels=["tier"])
    family.add_metric(["dram"], dram)
    family.add_metric(["ssd"], ssd)
    return family


class NodeCollector(Collector):
    """Hits and misses by tier, bytes per tier, evictions, demotions, rehydrations, leases."""

    def __init__(self, node: Callable[[], StoreNode | None]) -> None:
        """`node()` is the running node, or None while the role starts or stops."""
        self._node = node

    def collect(self) -> Iterator[Metric]:
        """One scrape."""
        node = self._node()
        if node is None:
            return
        s = node.stats()
        yield _by_tier("mooncake_store_objects", "objects held, by tier", GaugeMetricFamily,
                       s.dram_objects, s.ssd_objects)
        yield _by_tier("mooncake_store_bytes", "bytes in use, by tier", GaugeMetricFamily,
                       s.dram_bytes, s.ssd_bytes)
        yield _by_tier("mooncake_store_capacity_bytes", "capacity, by tier", GaugeMetricFamily,
                       s.dram_capacity, s.ssd_capacity)
        yield _by_tier("mooncake_store_hits", "keys found by get, by the tier they were in",
                       CounterMetricFamily, s.hits_dram, s.hits_ssd)
        yield _by_tier("mooncake_store_evictions", "objects evicted by LRU, by tier",
                       CounterMetricFamily, s.evictions, s.ssd_evictions)
        gauges = [
            ("mooncake_store_writing_objects", "objects reserved and being written", s.writing),
            ("mooncake_store_largest_free_bytes", "largest free DRAM extent", s.dram_largest_free),
            ("mooncake_store_active_leases", "gets whose blocks are still pinned", s.active_leases),
            ("mooncake_store_ssd_pending_bytes", "evicted bytes waiting to reach the SSD",
             s.ssd_pending_bytes),
            ("mooncake_store_draining_bytes",
             "freed DRAM bytes a get by key is still sending (reused once it is done)",
             s.draining_bytes),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("mooncake_store_misses", "keys asked for by get and held in no tier", s.misses),
            ("mooncake_store_demotions", "objects moved from DRAM to SSD", s.demotions),
            ("mooncake_store_demotions_dropped",
             "evicted objects the SSD tier could not take (full or busy)", s.demotions_dropped),
            ("mooncake_store_rehydrations", "objects read back from SSD into DRAM",
             s.rehydrations),
            ("mooncake_store_puts_refused", "keys refused by put_start for lack of space",
             s.puts_refused),
            ("mooncake_store_gets_by_key", ("objects read by key through the transfer engine "
                                            "(one round trip, no lease; also counted in hits)"),
             s.gets_by_key),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
