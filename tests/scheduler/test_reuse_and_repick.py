"""What each policy lets a prefill instance reuse, and the conductor's decode admission path."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sched_helpers import BT, MODEL, Clock, cluster, request
from test_policy import keys, scheduler

from mooncake_server.roles.conductor.admission_client import reserve_decode
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.roles.conductor.scheduler.oracle import STORE_WIDE
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler, SLORejected
from mooncake_server.wire.jobs import DecodeRelease, DecodeReserve


async def test_cache_global_fetches_from_the_store_only_when_it_chose_to() -> None:
    s = scheduler("cache-global", {"p1": 60, STORE_WIDE: 60})
    s.tracker.assign("busy", "p1", 5.0, "d1", 10)  # the holder is overloaded
    req = request("r", 1000)
    plan = await s.plan(req, keys(1000))
    assert plan is not None and plan.prefill.instance_id == "p2"
    assert plan.reuse == "global"  # p2 fetches the prefix from the store
    idle = scheduler("cache-global", {"p1": 60, STORE_WIDE: 60})
    req2 = request("r2", 1000)
    plan = await idle.plan(req2, keys(1000))
    assert plan is not None and plan.prefill.instance_id == "p1"
    assert plan.reuse == "local"  # its own cache has it all


@pytest.mark.parametrize("policy", ["cache-local", "load", "random"])
async def test_other_policies_reuse_only_the_local_cache(policy: str) -> None:
    s = scheduler(policy, {"p1": 60, STORE_WIDE: 60})
    s.tracker.assign("busy", "p1", 5.0, "d1", 10)
    req = request("r", 1000)
    plan = await s.plan(req, keys(1000))
    assert plan is not None and plan.reuse == "local"


async def test_repick_moves_the_request_to_the_next_decode_instance() -> None:
    s = scheduler("cache-global", decode=3)
    req = request("r", 100)
    plan = await s.plan(req, keys(100))
    assert plan is not None
    first = plan.decode.instance_id
    second = s.repick_decode(req, {first})
    assert second is not None and second.instance_id != first
    assert s.tracker.decode_of("r") == second.instance_id
    assert s.tracker.decode_load(first).batch == 0
    assert s.repick_decode(req, {"d1", "d2", "d3"}) is None


def test_repick_respects_the_tbt_slo() -> None:
    clock = Clock()
    s = KVCacheScheduler(cluster(1, 2, clock=clock), MODEL, block_tokens=BT, tbt_slo_s=0.03,
                         tracker=LoadTracker(clock))
    for i in range(3):  # d2 already runs 3 sequences: 20 + 5 x 4 = 40 ms > 30 ms
        s.tracker.assign(f"x{i}", "p1", 0.1, "d2", 10)
    assert s.repick_decode(request("r", 100), {"d1"}) is None


class Decodes(httpx.AsyncBaseTransport):
    """Decode instances answering /internal/decode/reserve: refuse (503), admit, or vanish."""

    def __init__(self, answers: dict[str, int | None]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.asked.append(host)
        DecodeReserve.model_validate_json(await request.aread())
        status = self.answers[host]
        if status is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status, json={"detail": "decode KV memory: full"})


async def reserve(answers: dict[str, int | None]) -> tuple[str, list[str]]:
    s = scheduler("cache-global", decode=len(answers))
    req = request("r", 100)
    plan = await s.plan(req, keys(100))
    assert plan is not None and plan.decode.instance_id == "d1"
    transport = Decodes(answers)
    async with httpx.AsyncClient(transport=transport) as http:
        got = await reserve_decode(http, {}, req, plan.decode, s.repick_decode)
    return got.instance_id, transport.asked


async def test_a_refusing_decode_instance_is_replaced_before_prefill() -> None:
    assert await reserve({"d1": 503, "d2": 200}) == ("d2", ["d1", "d2"])


async def test_an_unreachable_decode_instance_is_left_to_the_decode_job() -> None:
    assert await reserve({"d1": None, "d2": 200}) == ("d1", ["d1"])


async def test_when_every_decode_instance_refuses_the_answer_is_an_early_429() -> None:
    with pytest.raises(SLORejected) as info:
        await reserve({"d1": 503, "d2": 503})
    assert info.value.status == 429 and info.value.retry_after_s >= 1
    assert "KV memory" in str(info.value)


class Unanswered(httpx.AsyncBaseTransport):
    """A decode instance that never answers a reservation (it may have taken it) but releases."""

    def __init__(self) -> None:
        self.reserving = asyncio.Event()
        self.released: asyncio.Queue[str] = asyncio.Queue()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/decode/reserve":
            self.reserving.set()
            await asyncio.Event().wait()
        self.released.put_nowait(DecodeRelease.model_validate_json(await request.aread())
                                 .request_id)
        return httpx.Response(200, json={"released": True})


async def test_a_request_cancelled_while_reserving_releases_what_it_may_hold() -> None:
    s = scheduler("cache-global", decode=1)
    req = request("r", 100)
    plan = await s.plan(req, keys(100))
    assert plan is not None
    transport = Unanswered()
    async with httpx.AsyncClient(transport=transport) as http:
        task = asyncio.create_task(
            reserve_decode(http, {}, req, plan.decode, s.repick_decode))
        await transport.reserving.wait()
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.wait_for(transport.released.get(), 5) == "r"
