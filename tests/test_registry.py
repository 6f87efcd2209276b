"""Instance registry (conductor side) and Registrar (instance side)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from mooncake_server.instance.registrar import Registrar, RegistrationError
from mooncake_server.roles.conductor.registry import InstanceRegistry, registry_router
from mooncake_server.wire.instances import Heartbeat, InstanceInfo

SECRET = "s3cret"


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def info(instance_id: str, role: str = "prefill") -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role=role, url=f"http://{instance_id}:1")


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


def test_register_heartbeat_and_expiry() -> None:
    clock = FakeClock()
    reg = InstanceRegistry(heartbeat_timeout_s=5, clock=clock)
    reg.register(info("p1"))
    reg.register(info("d1", "decode"))
    assert [i.instance_id for i in reg.alive("prefill")] == ["p1"]
    assert reg.counts() == {"prefill": 1, "decode": 1, "store": 0}
    clock.now += 4
    assert reg.heartbeat(Heartbeat(instance_id="p1", running=3))
    assert reg.load("p1") is not None and reg.load("p1").running == 3
    clock.now += 4  # p1 heard from 4 s ago, d1 8 s ago
    assert [i.instance_id for i in reg.alive("prefill")] == ["p1"]
    assert reg.alive("decode") == [] and reg.pick("decode") is None
    status = {s.info.instance_id: s for s in reg.snapshot()}
    assert status["p1"].alive and not status["d1"].alive
    assert reg.heartbeat(Heartbeat(instance_id="d1"))  # a late heartbeat revives it
    assert reg.pick("decode") is not None


def test_unknown_and_forgotten_instances_must_register() -> None:
    clock = FakeClock()
    reg = InstanceRegistry(heartbeat_timeout_s=1, forget_after_s=10, clock=clock)
    assert not reg.heartbeat(Heartbeat(instance_id="ghost"))
    reg.register(info("p1"))
    clock.now += 11
    assert not reg.heartbeat(Heartbeat(instance_id="p1"))
    assert reg.get("p1") is None


def test_round_robin_skips_dead_instances() -> None:
    clock = FakeClock()
    reg = InstanceRegistry(heartbeat_timeout_s=5, clock=clock)
    for name in ("p1", "p2", "p3"):
        reg.register(info(name))
    picks = [reg.pick("prefill").instance_id for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["p1", "p2", "p3", "p1", "p2", "p3"]
    reg.mark_down("p2")
    picks = {reg.pick("prefill").instance_id for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"p1", "p3"}


def test_register_rejects_bad_role() -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=5)
    with pytest.raises(ValueError, match="role"):
        reg.register(info("x", "conductor"))


def make_app(reg: InstanceRegistry) -> FastAPI:
    app = FastAPI()
    app.include_router(registry_router(reg, SECRET))
    return app


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://conductor")


async def test_routes_need_the_secret_and_404_unknown_heartbeats() -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=5)
    headers = {"X-Mooncake-Secret": SECRET}
    async with client_for(make_app(reg)) as client:
        body = info("s1", "store").model_dump()
        assert (await client.post("/internal/register", json=body)).status_code == 401
        r = await client.post("/internal/register", json=body, headers=headers)
        assert r.status_code == 200 and r.json()["alive"]
        r = await client.post("/internal/heartbeat", json={"instance_id": "nope"}, headers=headers)
        assert r.status_code == 404
        r = await client.post("/internal/heartbeat", json={"instance_id": "s1", "running": 2},
                              headers=headers)
        assert r.status_code == 200
        r = await client.get("/internal/instances", headers=headers)
        assert [(s["info"]["instance_id"], s["load"]["running"]) for s in r.json()] == [("s1", 2)]
        bad = {**body, "role": "wizard"}
        assert (await client.post("/internal/register", json=bad, headers=headers)).status_code == 400


async def test_registrar_reregisters_after_conductor_forgets() -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=5)
    async with client_for(make_app(reg)) as http:
        registrar = Registrar("http://conductor", info("d1", "decode"), SECRET, 0.02,
                              load=lambda: Heartbeat(instance_id="d1", running=7), http=http)
        await registrar.start()
        assert reg.get("d1") is not None and registrar.registrations == 1
        await wait_for(lambda: reg.load("d1") is not None)
        assert reg.load("d1").running == 7  # type: ignore[union-attr]
        reg.deregister("d1")  # what a conductor restart looks like from here
        await wait_for(lambda: reg.get("d1") is not None)
        assert registrar.registrations == 2
        await registrar.stop()
        assert reg.get("d1") is None  # graceful stop deregisters


async def test_an_instance_is_registered_with_its_load() -> None:
    """The conductor places the first requests by the load report: it must not wait for the
    first heartbeat interval."""
    reg = InstanceRegistry(heartbeat_timeout_s=60)
    async with client_for(make_app(reg)) as http:
        registrar = Registrar("http://conductor", info("d1", "decode"), SECRET, 30.0,
                              load=lambda: Heartbeat(instance_id="d1", step_ratio=0.3),
                              http=http)
        await registrar.start()
        beat = reg.load("d1")
        assert beat is not None and beat.step_ratio == 0.3
        await registrar.stop()


class FlakyTransport(httpx.AsyncBaseTransport):
    """Refuses the first `failures` connections, then forwards to an ASGI app."""

    def __init__(self, app: FastAPI, failures: int) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.failures = failures

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.failures > 0:
            self.failures -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


async def test_registrar_retries_until_the_conductor_answers() -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=5)
    transport = FlakyTransport(make_app(reg), failures=3)
    async with httpx.AsyncClient(transport=transport) as http:
        registrar = Registrar("http://conductor", info("p1"), SECRET, 10.0, http=http,
                              max_backoff_s=0.05)
        await asyncio.wait_for(registrar.start(), timeout=5)
        assert transport.failures == 0 and reg.get("p1") is not None
        await registrar.stop()


async def test_registrar_gives_up_on_wrong_secret() -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=5)
    async with client_for(make_app(reg)) as http:
        registrar = Registrar("http://conductor", info("p1"), "wrong", 1.0, http=http)
        with pytest.raises(RegistrationError, match="401"):
            await asyncio.wait_for(registrar.start(), timeout=5)


async def test_registrar_survives_a_broken_load_callback(caplog: Any) -> None:
    reg = InstanceRegistry(heartbeat_timeout_s=5)

    def broken() -> Heartbeat:
        raise RuntimeError("gauge exploded")

    async with client_for(make_app(reg)) as http:
        registrar = Registrar("http://conductor", info("p1"), SECRET, 0.02, load=broken,
                              http=http)
        await registrar.start()
        await wait_for(lambda: reg.load("p1") is not None)
        await registrar.stop()
