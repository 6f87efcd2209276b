"""Prometheus view of the scheduler, read at scrape time (no state of its own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake_server.roles.conductor.scheduler.bursts import first_pass_share
from mooncake_server.roles.conductor.scheduler.outcomes import RECENT_RATIOS, VERDICTS
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler


class SchedulerCollector(Collector):
    """Rejections, requests in flight and their outcomes, and each prefill instance's estimated
    queue."""

    def __init__(self, scheduler: KVCacheScheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        """One sample per series."""
        s = self._scheduler
        rejected = CounterMetricFamily(
            "mooncake_scheduler_rejected", "Requests rejected early (429) because an SLO could "
            "not be met")
        rejected.add_metric([], s.rejected)
        yield rejected
        in_flight = GaugeMetricFamily("mooncake_scheduler_in_flight",
                                      "Requests placed and not finished")
        in_flight.add_metric([], s.tracker.in_flight())
        yield in_flight
        outcomes = CounterMetricFamily(
            "mooncake_scheduler_outcomes", "Placed requests by what they got against the SLOs "
            "(TBT: the mean of a request's longest tenth of token gaps after the second)",
            labels=["outcome"])
        for outcome in VERDICTS:
            outcomes.add_metric([outcome], s.outcomes.counts[outcome])
        yield outcomes
        yield from _ratio_quantiles(s)
        share = GaugeMetricFamily(
            "mooncake_scheduler_first_pass_slo_share", "Share of the TTFT SLO a burst's first "
            "pass past one chunk may take: room for 10% more than the most a long TTFT "
            "estimate ran over lately (0.8-0.95)")
        share.add_metric([], first_pass_share(s.outcomes.overrun()))
        yield share
        bursts = CounterMetricFamily("mooncake_scheduler_bursts",
                                     "Admission decisions (each over the requests that arrived "
                                     "together)")
        bursts.add_metric([], s.gate.bursts)
        yield bursts
        queue = GaugeMetricFamily("mooncake_scheduler_prefill_queue_seconds",
                                  "Estimated wait before a prefill instance starts a new job",
                                  labels=["instance"])
        for info in s.registry.alive("prefill"):
            queue.add_metric([info.instance_id], s.tracker.prefill_queue_s(
                info.instance_id, s.registry.load(info.instance_id)))
        yield queue


def _ratio_quantiles(s: KVCacheScheduler) -> Iterator[Metric]:
    """Measured / estimated TTFT and TBT over the recent finished requests: p50, p90."""
    for key in ("ttft", "tbt"):
        family = GaugeMetricFamily(
            f"mooncake_scheduler_{key}_measured_over_estimated",
            f"Measured / estimated {key.upper()} of the last {RECENT_RATIOS} finished requests "
            "(1.0: admission promised what they got)", labels=["quantile"])
        ratios = sorted(s.outcomes.ratios[key])
        for q in (0.5, 0.9):
            if ratios:
                family.add_metric([f"{q:g}"], ratios[min(len(ratios) - 1, int(q * len(ratios)))])
        yield family
