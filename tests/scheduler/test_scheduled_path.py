"""The request path with Algorithm 1 in front: an early 429 with Retry-After through the OpenAI
API, the ledger's feedback, and the plan's reuse reaching the prefill job."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sched_helpers import BT, MODEL, Clock, cluster

from mooncake_server.api.backend import GenerateRequest
from mooncake_server.api.openai_app import install_api
from mooncake_server.config import ServerConfig
from mooncake_server.roles.conductor.master_link import LocalMaster
from mooncake_server.roles.conductor.request_path import RequestPath
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.roles.conductor.scheduler.oracle import STORE_WIDE
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler
from mooncake_server.roles.master.master import StoreMaster
from mooncake_server.wire.jobs import PrefillJob, PrefillResult, SamplingParams


class Hits:
    """A prefix oracle with fixed answers."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits

    async def longest_prefix(self, keys: list[str]) -> dict[str, int]:
        return dict(self.hits)


class Peers(httpx.AsyncBaseTransport):
    """Prefill and decode instances that answer at once; the prefill records the job and what the
    scheduler's ledger says while it runs."""

    def __init__(self, scheduler: KVCacheScheduler) -> None:
        self.scheduler = scheduler
        self.jobs: list[tuple[str, PrefillJob]] = []
        self.queued_during_prefill: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = await request.aread()
        if path == "/internal/prefill":
            job = PrefillJob.model_validate_json(body)
            self.jobs.append((host, job))
            self.queued_during_prefill.append(self.scheduler.tracker.prefill_queue_len(host))
            return httpx.Response(200, content=PrefillResult(
                request_id=job.request_id, first_token=11, cached_tokens=0, tail_key=None,
                block_checksums=[], prefill_seconds=0.0).model_dump_json())
        if path == "/internal/decode":
            lines = [{"token_id": 12, "index": 1}, {"token_id": 13, "index": 2,
                                                    "finish_reason": "length"}]
            return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines))
        return httpx.Response(200, json={"ttl_s": 5.0, "released": True, "removed": 0})


def make(ttft_slo: float | None = None, hits: dict[str, int] | None = None,
         prefill: int = 1) -> tuple[KVCacheScheduler, Peers, httpx.AsyncClient, RequestPath]:
    clock = Clock()
    registry = cluster(prefill, 1, clock=clock)
    s = KVCacheScheduler(registry, MODEL, block_tokens=BT, ttft_slo_s=ttft_slo,
                         tracker=LoadTracker(clock), oracle=Hits(hits or {}))
    peers = Peers(s)
    http = httpx.AsyncClient(transport=peers)
    config = ServerConfig(role="conductor", block_tokens=BT)
    path = RequestPath(config, registry, http, s, LocalMaster(StoreMaster(registry, 1, "")))
    return s, peers, http, path


def req(rid: str = "r", n: int = 100) -> GenerateRequest:
    return GenerateRequest(rid, list(range(n)), SamplingParams(max_tokens=3, temperature=0.0))


async def test_ledger_follows_the_request() -> None:
    s, peers, http, path = make()
    async with http:
        events = [e async for e in path.generate(req())]
    assert [e.token_id for e in events] == [11, 12, 13]
    assert [host for host, _ in peers.jobs] == ["p1"]
    # Queued on p1 while its prefill ran, then out of the queue and the ledger.
    assert peers.queued_during_prefill == [1]
    assert s.tracker.prefill_queue_len("p1") == 0 and s.tracker.in_flight() == 0


async def test_the_plan_says_what_the_prefill_may_reuse() -> None:
    # p1 holds the prefix but is busy: cache-global sends the job to p2, fetching from the store.
    s, peers, http, path = make(hits={"p1": 6, STORE_WIDE: 6}, prefill=2)
    s.tracker.assign("busy", "p1", 5.0, "d1", 10)
    async with http:
        assert [e.token_id async for e in path.generate(req())] == [11, 12, 13]
    host, job = peers.jobs[0]
    assert host == "p2" and job.reuse == "global" and len(job.block_keys) == 100 // BT


async def test_api_answers_429_with_retry_after_before_any_work(tokenizer) -> None:
    s, peers, http, path = make(ttft_slo=0.5)
    s.tracker.assign("busy", "p1", 4.0, "d1", 10)  # 4 s of prefill queued on the only instance
    app = FastAPI()
    install_api(app, path, tokenizer, "test-model", 2048, CollectorRegistry())
    async with http, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                       base_url="http://t") as client:
        r = await client.post("/v1/completions", json={
            "model": "test-model", "prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "4"
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "slo_unattainable"
    assert "TTFT" in error["message"]
    assert peers.jobs == []  # rejected before reaching any instance
    assert s.tracker.in_flight() == 1  # only the busy request


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mooncake_server.model_assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))
