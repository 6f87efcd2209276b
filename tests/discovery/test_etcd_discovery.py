"""Discovery on a real etcd: instances held by leases, a conductor's registry following them,
instances following the conductors, and an etcd outage survived with the view held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request

from mooncake_server.config import ServerConfig
from mooncake_server.discovery.conductors import ConductorSet
from mooncake_server.discovery.etcd import EtcdSession, EtcdSettings, EtcdUnavailable
from mooncake_server.discovery.leased_key import LeasedKey
from mooncake_server.discovery.sealed import seal
from mooncake_server.instance.membership import Cluster, Membership
from mooncake_server.roles.conductor.etcd_feed import RegistryFeed
from mooncake_server.roles.conductor.registry import InstanceRegistry, registry_router
from mooncake_server.wire.instances import ConductorInfo, InstanceInfo
from mooncake_server.wire.routes import HEARTBEAT
from mooncake_testkit.etcd_proc import EtcdProc
from mooncake_testkit.in_process import serve_app

TTL = 2


def settings(etcd: EtcdProc) -> EtcdSettings:
    return EtcdSettings((("127.0.0.1", etcd.client_port),), "/test/", TTL)


async def until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.02)


async def session(etcd: EtcdProc) -> EtcdSession:
    s = EtcdSession(settings(etcd))
    await s.connect()
    return s


def decode(instance_id: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role="decode", url=f"http://{instance_id}:1")


async def publish(s: EtcdSession, info: InstanceInfo) -> LeasedKey:
    key = LeasedKey(s, settings_of(s).instance_key(info.role, info.instance_id),
                    info.model_dump_json().encode(), TTL)
    await key.start()
    assert await key.wait_published(5)
    return key


def settings_of(s: EtcdSession) -> EtcdSettings:
    return s.settings


async def test_registry_follows_leases_in_and_out(etcd: EtcdProc) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=30)
    feed = RegistryFeed(settings(etcd), registry,
                        ConductorInfo(conductor_id="c1", url="http://c1:1"))
    instance = await session(etcd)
    early = await publish(instance, decode("d-early"))  # there before the conductor
    await feed.start()
    try:
        assert registry.get("d-early") == decode("d-early")  # known before serving
        late = await publish(instance, decode("d-late"))
        await until(lambda: registry.get("d-late") is not None, 5, "a new instance seen")
        assert [i.instance_id for i in registry.alive("decode")] == ["d-early", "d-late"]

        await late.stop()  # graceful: the lease is revoked, gone at once
        await until(lambda: registry.get("d-late") is None, 2, "a revoked instance dropped")

        # A killed process renews nothing: its key expires with the lease, and it is dropped.
        lease = await instance.grant(TTL)
        key = settings(etcd).instance_key("decode", "d-killed")
        await instance.put(key, seal("", key, decode("d-killed").model_dump_json().encode()),
                           lease)
        await until(lambda: registry.get("d-killed") is not None, 5, "d-killed seen")
        killed_at = time.monotonic()
        await until(lambda: registry.get("d-killed") is None, TTL + 3, "expired lease dropped")
        assert time.monotonic() - killed_at <= TTL + 2
        assert registry.get("d-early") is not None  # renewed all along
        assert feed.connected
    finally:
        await early.stop()
        await feed.stop()
        await instance.close()


async def test_instances_follow_the_conductors(etcd: EtcdProc) -> None:
    conductor = RegistryFeed(settings(etcd), InstanceRegistry(heartbeat_timeout_s=30),
                             ConductorInfo(conductor_id="c1", url="http://c1:8000/"))
    s = await session(etcd)
    joined: list[str] = []
    left: list[str] = []
    conductors = ConductorSet(("http://named:8000",), s, settings(etcd))
    await conductors.start(wait_s=5)
    conductors.subscribe(joined.append, left.append)
    try:
        assert joined == ["http://named:8000"] and conductors.current() == "http://named:8000"
        await conductor.start()
        await until(lambda: "http://c1:8000" in joined, 5, "the conductor found in etcd")
        assert conductors.urls() == ["http://named:8000", "http://c1:8000"]
        await conductor.stop()
        await until(lambda: left == ["http://c1:8000"], 5, "the conductor leaving")
        assert conductors.urls() == ["http://named:8000"]  # a named one never leaves
    finally:
        await conductors.stop()
        await s.close()


async def test_etcd_outage_keeps_the_view_and_the_leases_come_back(etcd: EtcdProc) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=60)
    feed = RegistryFeed(settings(etcd), registry,
                        ConductorInfo(conductor_id="c1", url="http://c1:1"))
    instance = await session(etcd)
    key = await publish(instance, decode("d1"))
    await feed.start()
    try:
        assert registry.get("d1") is not None and feed.connected
        etcd.stop()
        await until(lambda: not feed.connected and not key.connected, 10, "outage noticed")
        assert registry.get("d1") is not None  # the view is held, nothing is dropped
        etcd.start()
        await until(lambda: feed.connected and key.connected, 15, "etcd back")
        assert registry.get("d1") is not None
        listing = await instance.list(settings(etcd).instances_prefix)
        assert list(listing.items) == [settings(etcd).instance_key("decode", "d1")]
    finally:
        await key.stop()
        await feed.stop()
        await instance.close()


async def test_a_conductor_that_etcd_lost_but_answers_keeps_the_heartbeats(
        etcd: EtcdProc) -> None:
    """etcd ending a conductor's lease (it was away past the TTL) while the conductor serves
    must not silence an instance's heartbeats there: the conductor would count the instance
    dead and answer 503 until it published itself again. A conductor that stops answering is
    left at once."""
    registry = InstanceRegistry(heartbeat_timeout_s=30)
    app = FastAPI()
    app.include_router(registry_router(registry, ""))
    beats = 0

    @app.middleware("http")
    async def count_heartbeats(request: Request, call_next: Any) -> Any:
        nonlocal beats
        beats += request.url.path == HEARTBEAT.path
        return await call_next(request)

    config = ServerConfig(role="store", etcd_endpoints=f"127.0.0.1:{etcd.client_port}",
                          etcd_prefix="/test/", etcd_lease_ttl_s=TTL, heartbeat_interval_s=0.05)
    cluster = Cluster(config)
    await cluster.start()
    store = InstanceInfo(instance_id="s1", role="store", url="http://s1:1")
    member = Membership(config, cluster, store)
    await member.start()
    conductor_session = await session(etcd)
    try:
        async with serve_app(app) as url:
            key = LeasedKey(conductor_session, settings(etcd).conductor_key("c1"),
                            ConductorInfo(conductor_id="c1", url=url).model_dump_json().encode(),
                            TTL)
            await key.start()
            await until(lambda: registry.load("s1") is not None, 5, "s1 heartbeats to c1")
            registrar = member.registrar(url)
            assert registrar is not None

            await key.stop()  # the key is gone; the conductor serves on
            await until(lambda: url not in cluster.conductors.urls(), 5, "c1 left etcd")
            before = beats
            await until(lambda: beats >= before + 3, 5,
                        "heartbeats go on to a conductor that answers")
            assert member.registrar(url) is registrar

            key = LeasedKey(conductor_session, key.key,
                            ConductorInfo(conductor_id="c1", url=url).model_dump_json().encode(),
                            TTL)
            await key.start()  # published again: the same registration carries on
            await until(lambda: url in cluster.conductors.urls(), 5, "c1 back in etcd")
            assert member.registrar(url) is registrar and registrar.registrations == 1
            await key.stop()
            await until(lambda: url not in cluster.conductors.urls(), 5, "c1 left etcd again")
        # the conductor stopped answering: its first failed heartbeat leaves it
        await until(lambda: member.registrar(url) is None, 5, "a silent conductor left")
    finally:
        await member.stop()
        await cluster.stop()
        await conductor_session.close()


def test_etcd_flags_are_checked_at_the_edge() -> None:
    config = ServerConfig(role="decode", etcd_endpoints="http://10.0.0.5:2379, 10.0.0.6:2380")
    assert config.etcd_targets == (("10.0.0.5", 2379), ("10.0.0.6", 2380))
    assert ServerConfig(role="store", conductor_url="http://a:1, http://b:2/").conductor_urls \
        == ("http://a:1", "http://b:2")
    for bad, flag in (({"etcd_endpoints": "http://nohost"}, "--etcd"),
                      ({"etcd_endpoints": "http://e:1", "etcd_cert": "c.pem"}, "--etcd-cert"),
                      ({"etcd_endpoints": "http://e:1", "etcd_prefix": "nope"}, "--etcd-prefix"),
                      ({"etcd_endpoints": "http://e:1", "etcd_lease_ttl_s": 1},
                       "--etcd-lease-ttl"),
                      ({}, "--conductor-url")):
        with pytest.raises(ValueError, match=flag):
            ServerConfig(role="decode", **bad)


async def test_a_member_not_sealed_with_the_cluster_secret_is_ignored(etcd: EtcdProc) -> None:
    secret = "cluster-secret"
    sealed = EtcdSettings((("127.0.0.1", etcd.client_port),), "/test/", TTL, secret=secret)
    registry = InstanceRegistry(heartbeat_timeout_s=30)
    feed = RegistryFeed(sealed, registry, ConductorInfo(conductor_id="c1", url="http://c1:1"))
    await feed.start()
    writer = EtcdSession(sealed)
    await writer.connect()
    try:
        forged = decode("forged").model_dump_json().encode()
        await writer.put(sealed.instance_key("decode", "forged"), forged)  # etcd access only
        wrong = EtcdSettings(sealed.targets, "/test/", TTL, secret="another-secret")
        await writer.put(sealed.instance_key("decode", "wrong"), seal(
            wrong.secret, wrong.instance_key("decode", "wrong"),
            decode("wrong").model_dump_json().encode()))
        moved = seal(secret, sealed.conductor_key("c9"), decode("moved").model_dump_json()
                     .encode())  # sealed, but for another key
        await writer.put(sealed.instance_key("decode", "moved"), moved)
        good = LeasedKey(writer, sealed.instance_key("decode", "good"),
                         decode("good").model_dump_json().encode(), TTL)
        await good.start()
        await until(lambda: registry.get("good") is not None, 5, "the sealed member seen")
        assert [i.instance_id for i in registry.alive("decode")] == ["good"]
        await good.stop()
    finally:
        await feed.stop()
        await writer.close()


async def test_etcd_auth_is_passed_through(etcd: EtcdProc) -> None:
    import etcd3aio

    admin = etcd3aio.Etcd3Client([f"127.0.0.1:{etcd.client_port}"])
    await admin.connect()
    await admin.auth.user_add("root", "root-pass")
    await admin.auth.user_grant_role("root", "root")
    await admin.auth.auth_enable()
    await admin.close()
    base = settings(etcd)
    with_user = EtcdSettings(base.targets, base.prefix, TTL, user="root", password="root-pass")
    s = EtcdSession(with_user)
    await s.connect()
    anonymous = await session(etcd)
    try:
        await s.put("/test/x", b"1")
        assert (await s.list("/test/")).items == {"/test/x": b"1"}
        with pytest.raises(EtcdUnavailable):
            await anonymous.list("/test/")
        with pytest.raises(EtcdUnavailable, match="authentication failed"):
            await EtcdSession(EtcdSettings(base.targets, base.prefix, TTL, user="root",
                                           password="wrong")).connect()
    finally:
        await s.close()
        await anonymous.close()
