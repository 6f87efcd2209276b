"""Network faults between roles in network namespaces (root and `ip netns` needed).

    root (test client) --veth-- A: conductor, prefill-0, decode-1 --veth-- B: store-0, decode-0

Every role uses TCP for KV (shared memory would bypass the network). Faults hit the A-B link:
packet loss (iptables statistic), added delay (tbf shaping; this kernel has no netem) and the
link taken down while a stream runs on decode-0 in B. Requests must give the uninterrupted
greedy output or an error within their bound, never hang; afterwards nothing stays pinned.
Only inside namespaces do dead paths behave like real ones (from the root namespace of these
VMs a connect() to an unreachable address can appear to succeed).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fault_helpers import (
    Stream,
    metric,
    prompt_ids,
    role_metric,
    serving,
    stream_completion,
    until,
    wait_sync,
)

from mooncake_testkit.role_procs import RoleCluster

TAG = os.getpid() % 100000
NS_A, NS_B = f"mcfa{TAG}", f"mcfb{TAG}"
ROOT_DEV, A_UP = f"mfr{TAG}", f"mfa{TAG}"  # root <-> A
A_DOWN, B_DEV = f"mfx{TAG}", f"mfb{TAG}"  # A <-> B (the faulty link)
# Subnets per test process too: two runs at once must not share addresses or root routes.
NET = TAG % 250
ROOT_NET, AB_NET = f"10.81.{NET}", f"10.82.{NET}"
ROOT_IP, A_UP_IP = f"{ROOT_NET}.1", f"{ROOT_NET}.2"
A_IP, B_IP = f"{AB_NET}.1", f"{AB_NET}.2"
BOUND_S = 60.0  # no request may take longer than this, fault or not


def _netns_usable() -> bool:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "iptables", "tc")):
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True,
                          check=False).returncode == 0


pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not _netns_usable(), reason="needs root, ip, iptables, tc")]


def sh(*argv: str, ns: str | None = None) -> None:
    """Run a network command (in namespace `ns`)."""
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, *argv], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def namespaces() -> Iterator[None]:
    """root <-> A <-> B, routed so the test reaches every role; removed whatever happens."""
    try:
        sh("ip", "netns", "add", NS_A)
        sh("ip", "netns", "add", NS_B)
        sh("ip", "link", "add", ROOT_DEV, "type", "veth", "peer", "name", A_UP, "netns", NS_A)
        sh("ip", "link", "add", A_DOWN, "netns", NS_A, "type", "veth", "peer", "name", B_DEV,
           "netns", NS_B)
        sh("ip", "addr", "add", f"{ROOT_IP}/24", "dev", ROOT_DEV)
        sh("ip", "link", "set", ROOT_DEV, "up")
        for ns, dev, addr in ((NS_A, A_UP, A_UP_IP), (NS_A, A_DOWN, A_IP), (NS_B, B_DEV, B_IP)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "route", "add", f"{AB_NET}.0/24", "via", A_UP_IP)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=NS_A)
        sh("ip", "route", "add", f"{ROOT_NET}.0/24", "via", A_IP, ns=NS_B)
        yield
    finally:
        subprocess.run(["ip", "route", "del", f"{AB_NET}.0/24"], capture_output=True,
                       check=False)
        for ns in (NS_A, NS_B):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", ROOT_DEV], capture_output=True, check=False)


@pytest.fixture(scope="module")
def net_cluster(namespaces: None, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[RoleCluster]:
    """The roles placed across the namespaces, KV over TCP."""
    common = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2", "--transport", "tcp",
              "--transfer-timeout", "3", "--log-level", "warning"]
    engine = ["--kv-memory", "192MiB", "--torch-threads", "1"]
    cluster = RoleCluster(log_dir=tmp_path_factory.mktemp("netns-logs"), common=common)
    cluster.add("conductor", "conductor", "--failover-wait", "20", host="0.0.0.0",
                advertise=A_IP, netns=NS_A)
    cluster.add("store", "store-0", "--memory", "256MiB", host=B_IP, netns=NS_B)
    cluster.add("prefill", "prefill-0", *engine, host=A_IP, netns=NS_A)
    # decode-0 sorts first: with equal load the scheduler puts requests there, across the link.
    cluster.add("decode", "decode-0", *engine, host=B_IP, netns=NS_B)
    cluster.add("decode", "decode-1", *engine, host=A_IP, netns=NS_A)
    with cluster:
        cluster.start()
        yield cluster


def _status(cluster: RoleCluster) -> dict[str, Any]:
    return {s["info"]["instance_id"]: s for s in cluster.instances()}


def _settled(cluster: RoleCluster, free: dict[str, int]) -> bool:
    """Nothing pinned or running anywhere: store leases and reservations, decode sequences,
    KV blocks held by write-backs, requests in the conductor."""
    status = _status(cluster)
    for name in ("decode-0", "decode-1"):
        load = (status.get(name) or {}).get("load") or {}
        if load.get("running") or load.get("waiting") or load.get("free_blocks") != free[name]:
            return False
        if role_metric(cluster, name, "mooncake_decode_writeback_held_blocks"):
            return False
    store = cluster.metrics("store-0")
    conductor = cluster.metrics("conductor")
    return (metric(store, "mooncake_store_active_leases") == 0
            and metric(store, "mooncake_store_writing_objects") == 0
            and metric(conductor, "mooncake_conductor_requests_running") == 0)


async def _bounded(cluster: RoleCluster, prompt: list[int], max_tokens: int) -> Stream:
    started = time.monotonic()
    out = await asyncio.wait_for(stream_completion(cluster.url, prompt, max_tokens), BOUND_S)
    assert time.monotonic() - started < BOUND_S
    return out


async def test_loss_delay_and_link_down_end_well(net_cluster: RoleCluster) -> None:
    cluster = net_cluster
    decodes = ("decode-0", "decode-1")
    wait_sync(lambda: all(_status(cluster)[n]["load"] for n in decodes), 10, "load reports")
    free = {n: _status(cluster)[n]["load"]["free_blocks"] for n in decodes}
    prompts = [prompt_ids(70, seed=50 + i) for i in range(3)]
    reference = [(await _bounded(cluster, p, 24)).tokens for p in prompts]

    # 1. 10% of the packets B receives are dropped: TCP retransmits, outputs unchanged.
    rule = ["INPUT", "-i", B_DEV, "-m", "statistic", "--mode", "random", "--probability",
            "0.1", "-j", "DROP"]
    sh("iptables", "-A", *rule, ns=NS_B)
    try:
        outs = await asyncio.gather(*[_bounded(cluster, p, 24) for p in prompts])
        assert [o.tokens for o in outs] == reference
    finally:
        sh("iptables", "-D", *rule, ns=NS_B)

    # 2. Both ends of the link shaped to 30 Mbit/s with queueing delay: KV crawls, same output.
    for ns, dev in ((NS_A, A_DOWN), (NS_B, B_DEV)):
        sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "30mbit", "burst", "32kbit",
           "latency", "400ms", ns=ns)
    try:
        outs = await asyncio.gather(*[_bounded(cluster, p, 24) for p in prompts])
        assert [o.tokens for o in outs] == reference
    finally:
        for ns, dev in ((NS_A, A_DOWN), (NS_B, B_DEV)):
            sh("tc", "qdisc", "del", "dev", dev, "root", ns=ns)

    # 3. The link goes down while decode-0 (in B) streams: its heartbeats stop, the conductor
    # moves the request to decode-1, which cannot reach the store either and recomputes.
    prompt = prompt_ids(50, seed=60)
    expected = (await _bounded(cluster, prompt, 60)).tokens
    recomputed = role_metric(cluster, "decode-1", "mooncake_decode_recomputed_tokens")
    out = Stream()
    task = asyncio.create_task(stream_completion(cluster.url, prompt, 60, out))
    await until(lambda: len(out.tokens) >= 10 or task.done(), BOUND_S, "tokens flowing")
    if serving(cluster, out.request_id) != "decode-0":  # the scheduler chose the near one
        async with httpx.AsyncClient(headers=cluster.headers, timeout=5) as http:
            r = await http.post(cluster.url + "/internal/migrate",
                                json={"request_id": out.request_id, "target": "decode-0"})
        assert r.status_code == 200, r.text
        await until(lambda: serving(cluster, out.request_id) == "decode-0", 10, "moved")
    seen = len(out.tokens)
    await until(lambda: len(out.tokens) >= seen + 3, BOUND_S, "tokens from decode-0")
    sh("ip", "link", "set", A_DOWN, "down", ns=NS_A)
    try:
        # A new request as B is cut off: its store writes fail within the transfer timeout
        # and it completes; or, once the conductor saw the only store node die, it is
        # refused at once (503). Never a hang.
        fresh = Stream()
        try:
            await asyncio.wait_for(stream_completion(cluster.url, prompt_ids(40, seed=61), 8,
                                                     fresh), BOUND_S)
            assert len(fresh.tokens) == 8
        except AssertionError:
            assert fresh.status == 503, fresh
        result = await asyncio.wait_for(task, BOUND_S)
        assert result.tokens == expected
        assert role_metric(cluster, "decode-1", "mooncake_decode_recomputed_tokens") > recomputed
    finally:
        sh("ip", "link", "set", A_DOWN, "up", ns=NS_A)
        sh("ip", "route", "replace", f"{ROOT_NET}.0/24", "via", A_IP, ns=NS_B)

    # The link back: B's roles are picked again and nothing stays pinned or running.
    cluster.wait_registered(["store-0", "decode-0"], 30)
    await asyncio.to_thread(wait_sync, lambda: _settled(cluster, free), 30,
                            "leases, reservations, sequences and held blocks back to zero")
    again = await _bounded(cluster, prompts[0], 24)
    assert again.tokens == reference[0]
