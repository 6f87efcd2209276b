"""ScheduledBackend through the OpenAI API: an early 429 with Retry-After, and the ledger's feedback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sched_helpers import BT, MODEL, Clock, cluster

from mooncake_server.api.backend import GenerateRequest, TokenEvent
from mooncake_server.api.openai_app import install_api
from mooncake_server.roles.conductor.scheduler import ScheduledBackend
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler


@dataclass
class Inner:
    """Stands in for DisaggregatedBackend: asks the picker like it does, yields 3 tokens."""

    scheduler: KVCacheScheduler
    namespace: str = "test"
    placed: list[tuple[str, str]] = field(default_factory=list)
    in_flight_seen: list[int] = field(default_factory=list)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        prefill = self.scheduler.pick_prefill(request, [])
        decode = self.scheduler.pick_decode(request)
        assert prefill is not None and decode is not None
        self.placed.append((prefill.instance_id, decode.instance_id))
        for i, token in enumerate((11, 12, 13)):
            self.in_flight_seen.append(
                self.scheduler.tracker.prefill_queue_len(prefill.instance_id))
            yield TokenEvent(token, "length" if i == 2 else None)

    def ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mooncake_server.model_assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


def make(ttft_slo: float | None) -> tuple[KVCacheScheduler, Inner, ScheduledBackend]:
    clock = Clock()
    s = KVCacheScheduler(cluster(1, 1, clock=clock), MODEL, block_tokens=BT,
                         ttft_slo_s=ttft_slo, tracker=LoadTracker(clock))
    inner = Inner(s)
    return s, inner, ScheduledBackend(inner, s)


async def test_ledger_follows_the_request() -> None:
    s, inner, backend = make(None)
    req = GenerateRequest("r", list(range(100)), _sampling())
    events = [e async for e in backend.generate(req)]
    assert [e.token_id for e in events] == [11, 12, 13]
    assert inner.placed == [("p1", "d1")]
    # Queued on p1 until its first token arrived, then out of the prefill queue.
    assert inner.in_flight_seen == [1, 0, 0]
    assert s.tracker.in_flight() == 0


async def test_api_answers_429_with_retry_after_before_any_work(tokenizer) -> None:
    s, inner, backend = make(ttft_slo=0.5)
    s.tracker.assign("busy", "p1", 4.0, "d1", 10)  # 4 s of prefill queued on the only instance
    app = FastAPI()
    install_api(app, backend, tokenizer, "test-model", 2048, CollectorRegistry())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        r = await client.post("/v1/completions", json={
            "model": "test-model", "prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "4"
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "slo_unattainable"
    assert "TTFT" in error["message"]
    assert inner.placed == []  # rejected before reaching any instance
    assert s.tracker.in_flight() == 1


def _sampling():
    from mooncake_server.wire.jobs import SamplingParams

    return SamplingParams(max_tokens=3, temperature=0.0)
