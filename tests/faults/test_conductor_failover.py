"""No single conductor (--etcd): two conductors over one real etcd, with a store, a prefill and
two decode instances, each its own OS process. A conductor SIGKILLed mid-stream costs only its
own streams; etcd stopped for 10 s costs no request at all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from fault_helpers import Stream, complete, metric, prompt_ids, stream_completion, until

from mooncake_server.discovery.etcd import EtcdSession, EtcdSettings
from mooncake_testkit.etcd_proc import EtcdProc, etcd_available
from mooncake_testkit.role_procs import RoleCluster

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not etcd_available(), reason="needs etcd (Debian etcd-server)")]

TTL = 2  # --etcd-lease-ttl: a killed process leaves etcd within 2 s
FAST = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2", "--etcd-lease-ttl", str(TTL),
        "--log-level", "warning"]
ENGINE = ["--kv-memory", "256MiB", "--torch-threads", "1", "--transfer-timeout", "3"]
INSTANCES = ["store-0", "prefill-0", "decode-0", "decode-1"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProc]:
    """A real etcd on a loopback port (its data kept across a stop and start)."""
    base = tmp_path_factory.mktemp("etcd")
    proc = EtcdProc(base / "data", base / "etcd.log").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def pair(etcd: EtcdProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoleCluster]:
    """Conductors `conductor-a` and `conductor-b`; the instances know neither: etcd tells them."""
    cluster = RoleCluster(log_dir=tmp_path_factory.mktemp("etcd-logs"), etcd_url=etcd.url,
                          common=FAST)
    for name in ("conductor-a", "conductor-b"):
        cluster.add("conductor", name)
    cluster.add("store", "store-0", "--memory", "256MiB")
    cluster.add("prefill", "prefill-0", *ENGINE)
    for i in range(2):
        cluster.add("decode", f"decode-{i}", *ENGINE)
    with cluster:
        cluster.start()
        wait_seen(cluster, cluster.conductor_urls[1], INSTANCES)
        yield cluster


def seen_alive(cluster: RoleCluster, conductor: str) -> set[str]:
    """Instances `conductor` counts alive."""
    try:
        return {s["info"]["instance_id"] for s in cluster.instances(conductor) if s["alive"]}
    except (httpx.HTTPError, ValueError):
        return set()


def wait_seen(cluster: RoleCluster, conductor: str, names: list[str], timeout_s: float = 60
              ) -> None:
    """Wait until `conductor` counts every named instance alive."""
    deadline = time.monotonic() + timeout_s
    while not set(names) <= seen_alive(cluster, conductor):
        assert time.monotonic() < deadline, (names, seen_alive(cluster, conductor))
        time.sleep(0.1)


async def published(etcd: EtcdProc) -> set[str]:
    """Instance ids etcd holds keys for now."""
    session = EtcdSession(EtcdSettings((("127.0.0.1", etcd.client_port),), "/mooncake/", TTL))
    await session.connect()
    try:
        return {key.rsplit("/", 1)[-1] for key in
                (await session.list("/mooncake/instances/")).items}
    finally:
        await session.close()


def conductor_metric(cluster: RoleCluster, url: str, name: str) -> float:
    """One metric of the conductor at `url`."""
    return metric(httpx.get(url + "/metrics", headers=cluster.headers, timeout=5).text, name)


async def test_conductor_killed_mid_stream_costs_only_its_own_streams(
        pair: RoleCluster) -> None:
    a, b = pair.conductor_urls
    prompts = [prompt_ids(24, seed=100 + i) for i in range(8)]
    reference = [(await complete(b, p, MAX_TOKENS)).tokens for p in prompts]
    idle = pair.free_blocks()

    outs = [Stream() for _ in prompts]
    tasks = [asyncio.create_task(stream_completion(a if i % 2 == 0 else b, p, MAX_TOKENS,
                                                   outs[i], timeout_s=60))
             for i, p in enumerate(prompts)]
    await until(lambda: all(len(o.tokens) >= 4 for o in outs) or any(t.done() for t in tasks),
                60, "8 streams flowing")
    assert not any(t.done() for t in tasks), "a stream ended before the kill"
    pair["conductor-a"].kill()
    pair.conductor_url = b  # the cluster's view (instances, leftovers) now comes from B

    after = [asyncio.create_task(complete(b, p, MAX_TOKENS)) for p in prompts[:4]]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(results):
        if i % 2 == 0:  # A's streams end with an error, never with a truncated success
            assert isinstance(result, (httpx.HTTPError, AssertionError)), result
        else:
            assert isinstance(result, Stream) and result.tokens == reference[i], result
    assert [r.tokens for r in await asyncio.gather(*after)] == reference[:4]

    # B no longer lists A's instances as anyone else's: nothing A reserved, leased or pinned
    # is left once the lease TTL and the stream breaks have run their course.
    left = await asyncio.to_thread(pair.wait_idle, idle, 30.0)
    assert not left, left

    # A restarted A is healthy (it knows every instance, from etcd) before it listens, and
    # serves its first request at once.
    started = time.monotonic()
    pair["conductor-a"].start()
    await asyncio.to_thread(pair["conductor-a"].wait_healthy, 120)
    healthy = time.monotonic()
    out = await complete(a, prompts[0], MAX_TOKENS)
    print(f"restarted conductor: healthy {healthy - started:.1f} s after its start, first "
          f"completion {time.monotonic() - healthy:.2f} s later")
    assert out.tokens == reference[0]


async def test_etcd_outage_fails_no_request_and_heals(pair: RoleCluster, etcd: EtcdProc
                                                      ) -> None:
    a, b = pair.conductor_urls
    wait_seen(pair, a, INSTANCES)
    failures: list[BaseException] = []
    served = 0
    stop = asyncio.Event()

    async def traffic(url: str, seed: int) -> None:
        nonlocal served
        while not stop.is_set():
            try:
                out = await complete(url, prompt_ids(16, seed=seed), 8)
                assert len(out.tokens) == 8
                served += 1
            except (httpx.HTTPError, AssertionError) as exc:
                failures.append(exc)

    flows = [asyncio.create_task(traffic(url, seed)) for seed, url in enumerate((a, b, a, b))]
    await until(lambda: served >= 4, 60, "traffic flowing")
    etcd.stop()
    down_at = time.monotonic()
    await until(lambda: all(conductor_metric(pair, u, "mooncake_conductor_etcd_connected") == 0
                            for u in (a, b)), 15, "both conductors notice etcd is gone")
    health = httpx.get(a + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["etcd"].startswith("unreachable")

    # A new decode instance started meanwhile waits for etcd to learn the conductors.
    pair.add("decode", "decode-2", *ENGINE)
    pair["decode-2"].start()
    served_down = served
    # NOTE: the outage the issue asks for lasts 10 s of real time; requests flow throughout.
    await asyncio.sleep(max(0.0, 10.0 - (time.monotonic() - down_at)))
    assert served > served_down, "requests kept being served while etcd was down"
    etcd.start()

    for url in (a, b):
        await until(lambda u=url: conductor_metric(pair, u, "mooncake_conductor_etcd_connected")
                    == 1, 30, "etcd connected again")
        await asyncio.to_thread(wait_seen, pair, url, [*INSTANCES, "decode-2"], 120)
    deadline = time.monotonic() + 10  # every lease made again (decode-2's first)
    while (keys := await published(etcd)) != {*INSTANCES, "decode-2"}:
        assert time.monotonic() < deadline, keys
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*flows)
    assert not failures, failures[:3]
