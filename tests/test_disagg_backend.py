"""RequestPath against scripted prefill / decode / store peers (an httpx transport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.block_keys import block_keys
from mooncake_server.config import ServerConfig
from mooncake_server.roles.conductor.master_link import LocalMaster
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.request_path import RequestPath
from mooncake_server.roles.conductor.scheduler import build_scheduler
from mooncake_server.roles.master.master import StoreMaster
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.jobs import DecodeJob, PrefillJob, PrefillResult, SamplingParams

SECRET = "s3cret"
EOS = 2


class DecodeStream(httpx.AsyncByteStream):
    """NDJSON body of a decode response; optionally hangs; records being closed."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for line in self.peers.decode_lines:
            yield line.encode() + b"\n"
        if self.peers.decode_hang:
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.peers.decode_stream_closed = True


@dataclass
class Peers(httpx.AsyncBaseTransport):
    """Scripted peers: one transport answering as prefill (p1), decode (d1) and store (s1)."""

    first_token: int = 42
    cached_tokens: int = 16
    tail_key: str | None = "tail-key"
    prefill_status: int = 200
    decode_status: int = 200
    decode_lines: list[str] = field(default_factory=list)
    decode_hang: bool = False
    decode_stream_closed: bool = False
    prefill_jobs: list[PrefillJob] = field(default_factory=list)
    decode_jobs: list[DecodeJob] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    secrets_seen: set[str | None] = field(default_factory=set)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.secrets_seen.add(request.headers.get("x-mooncake-secret"))
        body = await request.aread()
        path = request.url.path
        if path == "/internal/prefill":
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"detail": "prefill KV cache full"})
            job = PrefillJob.model_validate_json(body)
            self.prefill_jobs.append(job)
            return httpx.Response(200, content=PrefillResult(
                request_id=job.request_id, first_token=self.first_token,
                cached_tokens=self.cached_tokens, tail_key=self.tail_key, block_checksums=[1, 2],
                prefill_seconds=0.01).model_dump_json())
        if path == "/internal/decode":
            if self.decode_status != 200:
                return httpx.Response(self.decode_status, text="decode exploded")
            self.decode_jobs.append(DecodeJob.model_validate_json(body))
            return httpx.Response(200, stream=DecodeStream(self))
        if path == "/store/remove":
            self.removed.extend(json.loads(body)["keys"])
            return httpx.Response(200, json={"removed": 1})
        return httpx.Response(404)


def decode_lines(tokens: list[int], last: str = "stop") -> list[str]:
    return [json.dumps({"token_id": t, "finish_reason": last if i == len(tokens) - 1 else None})
            for i, t in enumerate(tokens)]


def request_path(config: ServerConfig, registry: InstanceRegistry,
                 http: httpx.AsyncClient) -> RequestPath:
    """The conductor's request path as its app wires it (scheduler over the store index)."""
    master = LocalMaster(StoreMaster(registry, config.store_replicas, config.cluster_secret), http)
    return RequestPath(config, registry, http, build_scheduler(config, registry, master), master)


@pytest.fixture
def registry() -> InstanceRegistry:
    reg = InstanceRegistry(heartbeat_timeout_s=30)
    reg.register(InstanceInfo(instance_id="p1", role="prefill", url="http://p1"))
    reg.register(InstanceInfo(instance_id="d1", role="decode", url="http://d1"))
    reg.register(InstanceInfo(instance_id="s1", role="store", url="http://s1",
                              transfer_address="127.0.0.1:9", segment="seg"))
    return reg


@pytest.fixture
def peers() -> Peers:
    return Peers()


@pytest.fixture
async def backend(registry: InstanceRegistry, peers: Peers) -> AsyncIterator[RequestPath]:
    config = ServerConfig(role="conductor", block_tokens=4, cluster_secret=SECRET,
                          failover_wait_s=0.5)
    async with httpx.AsyncClient(transport=peers) as http:
        yield request_path(config, registry, http)


def request(n_prompt: int = 10, max_tokens: int = 8, ignore_eos: bool = False) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, eos_token_ids=[EOS], ignore_eos=ignore_eos)
    return GenerateRequest("req-1", list(range(100, 100 + n_prompt)), sampling)


async def collect(backend: RequestPath, req: GenerateRequest) -> list[TokenEvent]:
    """Every event of a request, then what it left to do in the background (tail removal)."""
    try:
        return [event async for event in backend.generate(req)]
    finally:
        await backend.settled()


async def test_prefill_then_decode(backend: RequestPath, peers: Peers) -> None:
    peers.decode_lines = decode_lines([7, 8, EOS])
    events = await collect(backend, request())
    assert [(e.token_id, e.finish_reason) for e in events] == [
        (42, None), (7, None), (8, None), (EOS, "stop")]
    assert events[0].cached_tokens == 16
    prefill, decode = peers.prefill_jobs[0], peers.decode_jobs[0]
    assert prefill.block_keys == block_keys(list(range(100, 110)), 4, backend.namespace)
    assert len(prefill.block_keys) == 2  # 10 tokens = 2 full blocks of 4 + a tail
    assert (decode.first_token, decode.tail_key, decode.block_keys) == (
        42, "tail-key", prefill.block_keys)
    assert decode.block_checksums == [1, 2]
    assert peers.secrets_seen == {SECRET}
    assert peers.removed == []  # the decode instance owns the tail now


@pytest.mark.parametrize("role", ["store", "prefill", "decode"])
async def test_missing_role_is_503(backend: RequestPath, registry: InstanceRegistry,
                                   role: str) -> None:
    registry.deregister({"store": "s1", "prefill": "p1", "decode": "d1"}[role])
    assert not backend.ready()
    with pytest.raises(BackendError, match=f"no {role} instance available") as info:
        await collect(backend, request())
    assert info.value.status == 503


async def test_eos_first_token_finishes_without_decode(backend: RequestPath,
                                                       peers: Peers) -> None:
    peers.first_token = EOS
    events = await collect(backend, request())
    assert [(e.token_id, e.finish_reason) for e in events] == [(EOS, "stop")]
    assert peers.decode_jobs == [] and peers.removed == ["tail-key"]


async def test_eos_first_token_with_ignore_eos_decodes(backend: RequestPath,
                                                       peers: Peers) -> None:
    peers.first_token = EOS
    peers.decode_lines = decode_lines([5], last="length")
    events = await collect(backend, request(ignore_eos=True))
    assert [e.finish_reason for e in events] == [None, "length"]


async def test_max_tokens_one(backend: RequestPath, peers: Peers) -> None:
    events = await collect(backend, request(max_tokens=1))
    assert [(e.token_id, e.finish_reason) for e in events] == [(42, "length")]
    assert peers.removed == ["tail-key"] and peers.decode_jobs == []


@pytest.mark.parametrize(("status", "expected"),
                         [(503, 503), (500, 502), (400, 400), (429, 429)])
async def test_prefill_failure(backend: RequestPath, peers: Peers, status: int,
                               expected: int) -> None:
    peers.prefill_status = status
    with pytest.raises(BackendError, match="prefill instance p1 failed: prefill KV cache full") \
            as info:
        await collect(backend, request())
    assert info.value.status == expected


async def test_with_a_ttft_slo_the_job_says_when_it_must_start(registry: InstanceRegistry,
                                                              peers: Peers) -> None:
    """The prefill job carries its burst's order, the seconds left to start it within the
    TTFT SLO (the prefill instance refuses it, 429 above, once that has passed) and to answer
    it."""
    peers.decode_lines = decode_lines([7, 8], "length")
    config = ServerConfig(role="conductor", block_tokens=4, cluster_secret=SECRET,
                          ttft_slo_s=5.0, tbt_slo_s=0.2)
    async with httpx.AsyncClient(transport=peers) as http:
        await collect(request_path(config, registry, http), request(max_tokens=3))
    job = peers.prefill_jobs[0]
    assert job.burst_at is not None and job.burst_rank == 0
    assert job.start_within_s is not None and 4.0 < job.start_within_s < 5.0
    # ... and when its first token is due: a first pass running late answers it early.
    assert job.answer_within_s is not None and job.start_within_s < job.answer_within_s <= 5.0
    # ... and when it is estimated: the instance packs no forward past it.
    assert job.expect_within_s is not None and 0 < job.expect_within_s < job.answer_within_s
    assert not job.pass_tail  # alone, it is no first pass's tail


async def test_decode_error_event(backend: RequestPath, peers: Peers) -> None:
    peers.decode_lines = [json.dumps({"token_id": 7}), json.dumps({"error": "KV load failed"})]
    got: list[TokenEvent] = []
    with pytest.raises(BackendError, match="KV load failed") as info:
        async for event in backend.generate(request()):
            got.append(event)
    assert info.value.status == 503 and [e.token_id for e in got] == [42, 7]


async def test_decode_refused_removes_tail(backend: RequestPath, peers: Peers) -> None:
    peers.decode_status = 503
    with pytest.raises(BackendError, match="decode exploded"):
        await collect(backend, request())
    assert peers.removed == ["tail-key"]


async def test_truncated_decode_stream_is_an_error(backend: RequestPath,
                                                   peers: Peers) -> None:
    peers.decode_lines = [json.dumps({"token_id": 7})]
    with pytest.raises(BackendError, match="without a final token"):
        await collect(backend, request())


async def test_closing_mid_decode_closes_the_stream(backend: RequestPath,
                                                    peers: Peers) -> None:
    peers.decode_lines = [json.dumps({"token_id": 7})]
    peers.decode_hang = True
    gen = backend.generate(request())
    assert (await anext(gen)).token_id == 42
    assert (await anext(gen)).token_id == 7
    await gen.aclose()
    await backend.settled()
    assert peers.decode_stream_closed
    assert peers.removed == []


async def test_closing_before_decode_removes_tail(backend: RequestPath,
                                                  peers: Peers) -> None:
    gen = backend.generate(request())
    assert (await anext(gen)).token_id == 42
    await gen.aclose()
    await backend.settled()
    assert peers.removed == ["tail-key"] and peers.decode_jobs == []


async def test_unreachable_prefill_is_marked_down(registry: InstanceRegistry) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    # NOTE: the conductor waits --failover-wait for another prefill instance before failing.
    config = ServerConfig(role="conductor", block_tokens=4, failover_wait_s=0.5)
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
        backend = request_path(config, registry, http)
        with pytest.raises(BackendError, match="unreachable") as info:
            await collect(backend, request())
    assert info.value.status == 503
    assert registry.alive("prefill") == []
