"""The prefill role's Prometheus series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class PrefillMetrics:
    """Prometheus series of the prefill role."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter("mooncake_prefill_jobs", "Prefill jobs by outcome", ["outcome"],
                            registry=registry)
        self.computed_tokens = Counter("mooncake_prefill_computed_tokens",
                                       "Prompt tokens computed", registry=registry)
        self.cached_tokens = Counter("mooncake_prefill_cached_tokens",
                                     "Prompt tokens reused (local cache or store)",
                                     registry=registry)
        self.local_tokens = Counter("mooncake_prefill_local_cache_tokens",
                                    "Prompt tokens reused from the instance's own prefix cache",
                                    registry=registry)
        self.cache_blocks = Gauge("mooncake_prefill_local_cache_blocks",
                                  "Full blocks held by the local prefix cache", registry=registry)
        self.seconds = Histogram("mooncake_prefill_seconds", "Prefill job wall time",
                                 registry=registry)
        self.batch_jobs = Histogram("mooncake_prefill_batch_jobs", "Jobs per forward batch",
                                    registry=registry, buckets=(1, 2, 4, 8, 16, 32))
        self.handoff_hold = Counter(
            "mooncake_prefill_handoff_hold_seconds",
            "Seconds passes waited for a decode on the same cores to start jobs handed to it",
            registry=registry)
        self.late_started = Counter(
            "mooncake_prefill_late_started",
            "Jobs started past their start deadline: this instance's own speed still ended them "
            "by their first token's deadline", registry=registry)
        self.held_handoffs = Histogram(
            "mooncake_prefill_held_handoff_seconds",
            "How long answered jobs waited to go on to the decode beside this instance while "
            "prompts queued behind them ran whole (hand_on.py)", registry=registry,
            buckets=(0.25, 0.5, 1, 2, 3, 4, 5, 8))
        self.store_errors = Counter("mooncake_prefill_store_errors",
                                    "KV loads / saves the store could not serve (recomputed)",
                                    ["op"], registry=registry)
