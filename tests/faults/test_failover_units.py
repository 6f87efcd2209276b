"""Failover logic against scripted peers (fast, no model): decode moves, de-duplication, prefill
re-sends, the heartbeat watchdog, draining in the registry, the SIGTERM drain of a server."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from mooncake_server.api.backend import BackendError, GenerateRequest
from mooncake_server.block_keys import block_keys
from mooncake_server.config import ServerConfig
from mooncake_server.instance.drain import DrainingServer
from mooncake_server.roles.conductor.master_link import LocalMaster
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.request_path import RequestPath
from mooncake_server.roles.conductor.scheduler import build_scheduler
from mooncake_server.roles.conductor.watch import STALLED, InstanceLost, LineFeed, MoveOrdered
from mooncake_server.roles.master.master import StoreMaster
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import (
    DecodeJob,
    ErrorEvent,
    PrefillFirst,
    PrefillJob,
    PrefillResult,
    SamplingParams,
)

BT = 4
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks and a tail
FIRST = 42
OUTPUT = [FIRST, *range(500, 512)]  # what an uninterrupted decode gives: 13 tokens


def line(token: int, index: int, last: bool = False) -> bytes:
    """One decode stream line."""
    return json.dumps({"token_id": token, "index": index,
                       "finish_reason": "length" if last else None}).encode() + b"\n"


class Lines(httpx.AsyncByteStream):
    """A decode stream: some lines, then the end, a broken connection, or silence."""

    def __init__(self, body: list[bytes], then: str, closed: list[str], name: str) -> None:
        self.body, self.then, self.closed, self.name = body, then, closed, name

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.body:
            yield chunk
            await asyncio.sleep(0)
        if self.then == "break":
            raise httpx.ReadError("connection reset by peer")
        if self.then == "hang":
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.append(self.name)


class PrefillLines(httpx.AsyncByteStream):
    """A streamed prefill answer: the first token, then (once stored) the result or an error."""

    def __init__(self, job: PrefillJob, token: int, then: str, stored: asyncio.Event) -> None:
        self.job, self.token, self.then, self.stored = job, token, then, stored

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield PrefillFirst(first_token=self.token).model_dump_json().encode() + b"\n"
        if self.then == "error":
            yield ErrorEvent(error="store transfer failed").model_dump_json().encode() + b"\n"
            return
        await self.stored.wait()
        yield PrefillResult(request_id=self.job.request_id, first_token=self.token,
                            cached_tokens=0, tail_key="tail/x", block_checksums=[11, 12, 13],
                            prefill_seconds=0.0).model_dump_json().encode() + b"\n"


@dataclass
class Peers(httpx.AsyncBaseTransport):
    """p1, p2 (prefill), d1, d2 (decode), s1 (store) behind one transport.

    `decode[name](job) -> (status, lines, then)` scripts each decode instance.
    """

    decode: dict[str, Callable[[DecodeJob], tuple[int, list[bytes], str]]]
    prefill_down: set[str] = field(default_factory=set)
    prefill_hang: set[str] = field(default_factory=set)
    prefill_jobs: list[str] = field(default_factory=list)
    decode_jobs: list[tuple[str, DecodeJob]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    # Streamed prefill answers, one per job in order: (first token, then "result" | "error").
    # The result waits for `stored` (the store writes of a real prefill instance).
    prefill_answers: list[tuple[int, str]] = field(default_factory=list)
    stored: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = await request.aread()
        if path == "/internal/prefill":
            if host in self.prefill_down:
                raise httpx.ConnectError("connection refused", request=request)
            if host in self.prefill_hang:
                await asyncio.Event().wait()
            job = PrefillJob.model_validate_json(body)
            self.prefill_jobs.append(host)
            if self.prefill_answers:
                token, then = self.prefill_answers.pop(0)
                return httpx.Response(200, stream=PrefillLines(job, token, then, self.stored))
            return httpx.Response(200, content=PrefillResult(
                request_id=job.request_id, first_token=FIRST, cached_tokens=0,
                tail_key="tail/x", block_checksums=[11, 12, 13],
                prefill_seconds=0.0).model_dump_json())
        if path == "/internal/decode":
            job = DecodeJob.model_validate_json(body)
            self.decode_jobs.append((host, job))
            status, lines, then = self.decode[host](job)
            if status != 200:
                return httpx.Response(status, json={"detail": "decode KV cache full"})
            return httpx.Response(200, stream=Lines(lines, then, self.closed, host))
        if path in ("/store/remove", "/internal/decode/reserve", "/internal/decode/release"):
            return httpx.Response(200, json={"removed": 1, "ttl_s": 5.0, "released": True})
        return httpx.Response(404)


def full_from(job: DecodeJob) -> tuple[int, list[bytes], str]:
    """A healthy decode instance: the rest of OUTPUT after what the job says the client has."""
    start = 1 + len(job.generated_token_ids)
    return 200, [line(OUTPUT[i], i, i == len(OUTPUT) - 1)
                 for i in range(start, len(OUTPUT))], "end"


def request_path(config: ServerConfig, registry: InstanceRegistry,
                 http: httpx.AsyncClient) -> RequestPath:
    """The conductor's request path as its app wires it (scheduler over the store index)."""
    master = LocalMaster(StoreMaster(registry, config.store_replicas, config.cluster_secret), http)
    return RequestPath(config, registry, http, build_scheduler(config, registry, master), master)


@pytest.fixture
def registry() -> InstanceRegistry:
    reg = InstanceRegistry(heartbeat_timeout_s=30)
    for iid, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")):
        reg.register(InstanceInfo(instance_id=iid, role=role, url=f"http://{iid}"))
    reg.register(InstanceInfo(instance_id="s1", role="store", url="http://s1",
                              transfer_address="127.0.0.1:9", segment="seg"))
    return reg


def backend_for(registry: InstanceRegistry, http: httpx.AsyncClient) -> RequestPath:
    config = ServerConfig(role="conductor", block_tokens=BT, failover_wait_s=0.5,
                          heartbeat_timeout_s=0.2)
    return request_path(config, registry, http)


def request() -> GenerateRequest:
    return GenerateRequest("req-1", PROMPT, SamplingParams(max_tokens=len(OUTPUT),
                                                           temperature=0, ignore_eos=True))


async def run(backend: RequestPath) -> list[int]:
    return [e.token_id async for e in backend.generate(request())]


async def test_broken_stream_resumes_on_the_other_decode_with_the_context(
        registry: InstanceRegistry) -> None:
    def dies_after_five(job: DecodeJob) -> tuple[int, list[bytes], str]:
        return 200, [line(OUTPUT[i], i) for i in range(1, 6)], "break"

    def repeats_one(job: DecodeJob) -> tuple[int, list[bytes], str]:
        # A resumed instance that (wrongly) repeats the last token it was given.
        status, lines, then = full_from(job)
        k = len(job.generated_token_ids)
        return status, [line(OUTPUT[k], k), *lines], then

    peers = Peers({"d1": dies_after_five, "d2": repeats_one})
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        assert await run(backend) == OUTPUT  # nothing lost, nothing repeated

    (first_at, first), (second_at, resumed) = peers.decode_jobs
    assert (first_at, second_at) == ("d1", "d2")
    assert first.generated_token_ids == [] and first.tail_key == "tail/x"
    assert resumed.generated_token_ids == OUTPUT[1:6]
    computed = PROMPT + OUTPUT[:5]  # every token but the newest has KV on d1
    assert resumed.block_keys == block_keys(computed, BT, backend.namespace)
    assert resumed.tail_key is None and resumed.block_checksums == [11, 12]
    assert backend.stats.decode_moves == {"died": 1}
    assert backend.stats.duplicates_dropped == 1
    assert not registry.is_alive("d1")  # marked down until it heartbeats again


async def test_an_ordered_move_leaves_at_the_next_token(registry: InstanceRegistry) -> None:
    def slow(job: DecodeJob) -> tuple[int, list[bytes], str]:
        return 200, [line(OUTPUT[i], i) for i in range(1, 4)], "hang"

    peers = Peers({"d1": slow, "d2": full_from})
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        gen = backend.generate(request())
        got = [(await anext(gen)).token_id for _ in range(4)]
        assert backend.running()[0].instance_id == "d1"
        with pytest.raises(LookupError):
            backend.migrate("nope", None)
        with pytest.raises(ValueError, match="already runs"):
            backend.migrate("req-1", "d1")
        with pytest.raises(ValueError, match="not a live decode"):
            backend.migrate("req-1", "p1")
        reply = backend.migrate("req-1", None)
        assert (reply.source, reply.target) == ("d1", "d2")
        got += [e.token_id async for e in gen]
    assert got == OUTPUT
    assert peers.closed[0] == "d1"  # the source's stream was closed: it frees the request
    assert backend.stats.decode_moves == {"ordered": 1}
    assert registry.is_alive("d1")  # a move on purpose is no failure


async def test_refused_job_goes_to_the_other_decode_at_once(registry: InstanceRegistry) -> None:
    peers = Peers({"d1": lambda job: (503, [], "end"), "d2": full_from})
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        assert await run(backend) == OUTPUT
    assert backend.stats.decode_moves == {"refused": 1}


async def test_a_silent_decode_that_misses_heartbeats_is_left(
        registry: InstanceRegistry) -> None:
    def silent(job: DecodeJob) -> tuple[int, list[bytes], str]:
        return 200, [line(OUTPUT[1], 1)], "hang"

    peers = Peers({"d1": silent, "d2": full_from})
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        task = asyncio.create_task(run(backend))
        await asyncio.sleep(0.3)
        assert not task.done()  # silence alone is no failure while heartbeats come
        registry.mark_down("d1")  # its heartbeats stop
        assert await asyncio.wait_for(task, 5) == OUTPUT
    assert backend.stats.decode_moves == {"stalled": 1}


async def test_no_decode_left_fails_with_the_reason(registry: InstanceRegistry) -> None:
    registry.deregister("d2")
    peers = Peers({"d1": lambda job: (200, [line(OUTPUT[1], 1)], "break")})
    async with httpx.AsyncClient(transport=peers) as http:
        with pytest.raises(BackendError, match="no other live decode instance") as info:
            await run(backend_for(registry, http))
    assert info.value.status == 503


async def test_skipped_tokens_are_an_error_not_a_silent_gap(registry: InstanceRegistry) -> None:
    peers = Peers({"d1": lambda job: (200, [line(OUTPUT[3], 3)], "end"), "d2": full_from})
    async with httpx.AsyncClient(transport=peers) as http:
        with pytest.raises(BackendError, match="skipped output tokens 1..2"):
            await run(backend_for(registry, http))


async def test_dead_prefill_instance_job_is_resent(registry: InstanceRegistry) -> None:
    peers = Peers({"d1": full_from, "d2": full_from}, prefill_down={"p1"})
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        assert await run(backend) == OUTPUT
    assert peers.prefill_jobs == ["p2"]
    assert backend.stats.prefill_resends == {"died": 1}


async def test_the_first_token_streams_before_the_prompt_kv_is_stored(
        registry: InstanceRegistry) -> None:
    peers = Peers({"d1": full_from, "d2": full_from}, prefill_answers=[(FIRST, "result")])
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        tokens = backend.generate(request())
        first = await asyncio.wait_for(anext(tokens), 5)
        assert first.token_id == FIRST
        assert peers.decode_jobs == []  # the prefill has not answered with its result yet
        peers.stored.set()
        assert [e.token_id async for e in tokens] == OUTPUT[1:]
    assert peers.decode_jobs[0][1].first_token == FIRST


async def test_a_prefill_resent_after_its_first_token_keeps_that_token(
        registry: InstanceRegistry) -> None:
    # The first instance streams FIRST, then fails its store writes; the job goes to the other
    # instance, which samples another first token (no seed): the client keeps the one it has,
    # and the decode continues from it.
    peers = Peers({"d1": full_from, "d2": full_from},
                  prefill_answers=[(FIRST, "error"), (FIRST + 1, "result")])
    peers.stored.set()
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        assert await run(backend) == OUTPUT
    assert len(peers.prefill_jobs) == 2 and len(set(peers.prefill_jobs)) == 2
    assert backend.stats.prefill_resends == {"error": 1}
    assert [job.first_token for _, job in peers.decode_jobs] == [FIRST]


async def test_hung_prefill_instance_that_misses_heartbeats_is_left(
        registry: InstanceRegistry) -> None:
    peers = Peers({"d1": full_from, "d2": full_from}, prefill_hang={"p1"})
    async with httpx.AsyncClient(transport=peers) as http:
        backend = backend_for(registry, http)
        task = asyncio.create_task(run(backend))
        await asyncio.sleep(0.3)
        assert not task.done()  # a long prefill is no failure while heartbeats come
        registry.mark_down("p1")
        assert await asyncio.wait_for(task, 5) == OUTPUT
    assert peers.prefill_jobs == ["p2"]
    assert backend.stats.prefill_resends == {"stalled": 1}


async def test_line_feed_watches_moves_and_heartbeats() -> None:
    async def read(emit: Callable[[str], None]) -> None:
        emit("a")
        await asyncio.Event().wait()

    move = asyncio.Event()
    feed = LineFeed(read)
    assert await feed.next(lambda: True, move, 0.05) == "a"
    move.set()
    with pytest.raises(MoveOrdered):
        await feed.next(lambda: True, move, 0.05)
    move.clear()
    with pytest.raises(InstanceLost) as info:
        await feed.next(lambda: False, move, 0.05)
    assert info.value.reason == STALLED
    await feed.aclose()


def test_draining_instance_is_not_picked_but_still_alive() -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=30)
    for iid in ("d1", "d2"):
        reg.register(InstanceInfo(instance_id=iid, role="decode", url=f"http://{iid}"))
    assert reg.drain("d1") and not reg.drain("nope")
    assert [i.instance_id for i in reg.alive("decode")] == ["d2"]
    assert {reg.pick("decode").instance_id for _ in range(4)} == {"d2"}  # type: ignore[union-attr]
    assert reg.is_alive("d1") and reg.heartbeat(Heartbeat(instance_id="d1"))
    assert reg.status("d1").draining  # type: ignore[union-attr]
    reg.register(InstanceInfo(instance_id="d1", role="decode", url="http://d1"))  # restarted
    assert not reg.status("d1").draining  # type: ignore[union-attr]


async def test_sigterm_drains_before_the_server_exits() -> None:
    app = FastAPI()
    drained = asyncio.Event()

    async def drain() -> None:
        await asyncio.sleep(0.05)
        drained.set()

    app.state.drain = drain
    server = DrainingServer(uvicorn.Config(app, port=0, log_level="warning"), app)
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit  # not yet: the drain runs first
    assert not await server.on_tick(0)
    await asyncio.wait_for(drained.wait(), 2)
    await asyncio.sleep(0)
    assert await server.on_tick(1) and server.should_exit
    server.handle_exit(signal.SIGTERM, None)  # a second signal: as uvicorn does
    assert server.should_exit
