"""`--role master`: the store master as its own process, and a conductor's `--master` link to it."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
from mooncake_rig import store_only

from mooncake_server.cli import parse_config
from mooncake_server.discovery.etcd import EtcdSession, EtcdSettings
from mooncake_server.roles.conductor.master_link import RemoteMaster
from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_testkit.etcd_proc import EtcdProc, etcd_available


def test_the_master_listens_on_mooncakes_port_by_default() -> None:
    config = parse_config(["--role", "master", "--cluster-secret", "s"], environ={})
    assert config.port == 50051
    store = parse_config(["--role", "store", "--master", "10.0.0.5:50051",
                          "--cluster-secret", "s"], environ={})
    assert store.master_base == "http://10.0.0.5:50051"


def test_a_conductor_asks_a_standalone_master_what_is_cached_and_where() -> None:
    with store_only(1, "16MiB") as cluster:
        client = cluster.client()
        try:
            assert client.put_batch(["p/0", "p/1"], [b"a", b"b"]) == 0
        finally:
            client.close()
        node = next(iter(cluster.nodes.values()))

        async def ask() -> tuple[int, object, object]:
            master = RemoteMaster(f"http://{cluster.master_addr}", cluster.secret)
            try:
                prefix = await master.prefix(["p/0", "p/1", "p/2"])
                master.reuse(["p/0"])
                return await master.store_nodes(), prefix, await master.locate(["p/1"])
            finally:
                await master.aclose()

        stores, prefix, where = asyncio.run(ask())
        assert stores == 1
        assert prefix.prefix == 2 and prefix.by_node == {"store-0": 2}  # type: ignore[attr-defined]
        assert prefix.urls["store-0"] == node.url  # type: ignore[attr-defined]
        assert [r.node_id for r in where.replicas[0]] == ["store-0"]  # type: ignore[attr-defined]


def test_the_master_serves_mooncakes_metadata_endpoint_to_cluster_members() -> None:
    with store_only(0) as cluster:
        assert cluster.master is not None
        url = cluster.master.url + "/metadata"
        auth = {SECRET_HEADER: cluster.secret}
        assert httpx.put(url, params={"key": "seg/a"}, content=b'{"x":1}',
                         headers=auth).status_code == 200
        assert httpx.get(url, params={"key": "seg/a"}, headers=auth).content == b'{"x":1}'
        assert httpx.get(url, params={"key": "seg/a"}).status_code in (401, 403)
        assert httpx.delete(url, params={"key": "seg/a"}, headers=auth).status_code == 200
        assert httpx.get(url, params={"key": "seg/a"}, headers=auth).status_code == 404


def test_with_etcd_the_master_publishes_itself_and_follows_the_nodes_leases(
        tmp_path: Path) -> None:
    if not etcd_available():
        pytest.skip("needs etcd (Debian etcd-server; scripts/setup.sh --test installs it)")
    etcd = EtcdProc(tmp_path / "data", tmp_path / "etcd.log").start()
    endpoint = f"http://127.0.0.1:{etcd.client_port}"
    try:
        with store_only(0, "16MiB", "--etcd", endpoint, "--etcd-lease-ttl", "2") as cluster:
            assert cluster.master is not None
            node = cluster.add_node("store-0", "16MiB", "--etcd", endpoint,
                                    "--etcd-lease-ttl", "2")
            health = httpx.get(cluster.master.url + "/health", timeout=5).json()
            assert health["etcd"] == "connected" and health["stores"] == 1

            async def published() -> list[str]:
                session = EtcdSession(EtcdSettings((("127.0.0.1", etcd.client_port),),
                                                   "/mooncake/", 2))
                await session.connect()
                try:
                    return list((await session.list("/mooncake/masters/")).items)
                finally:
                    await session.close()

            assert len(asyncio.run(published())) == 1
            client = cluster.client()
            try:
                value = os.urandom(4096)
                assert client.put("etcd/k", value) == 0 and client.get("etcd/k") == value
            finally:
                client.close()
            node.kill()  # no goodbye: its etcd lease runs out, and the master lets it go
            gone = time.monotonic()
            cluster.wait(lambda: cluster.stores() == 0, "the killed node dropped", 15.0)
            assert time.monotonic() - gone < 10.0
    finally:
        etcd.stop()
