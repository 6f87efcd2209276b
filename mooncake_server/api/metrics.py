"""Prometheus metrics of the OpenAI API layer (one set per CollectorRegistry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets in seconds: TTFT spans cached short prompts to long cold prefills.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ApiMetrics:
    """Request counts by status, token counters, TTFT / inter-token latency, running requests."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "mooncake_api_requests",
            "API requests by endpoint and final HTTP status ('stream_error' = failed mid-stream)",
            ["endpoint", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "mooncake_api_prompt_tokens", "Prompt tokens of admitted requests", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "mooncake_api_cached_prompt_tokens",
            "Prompt tokens whose KV was reused instead of computed",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "mooncake_api_generation_tokens", "Generated tokens", registry=registry
        )
        self.ttft = Histogram(
            "mooncake_api_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "mooncake_api_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.running = Gauge(
            "mooncake_api_requests_running", "Requests currently generating", registry=registry
        )

    def count(self, endpoint: str, status: int | str) -> None:
        """Count one finished request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
