"""Prefill, store and conductor faults on the real model: a prefill instance SIGKILLed with
jobs queued and running, store nodes dying with two replicas and with the only copy, the
conductor restarted. Requests only see latency; outputs stay the uninterrupted greedy ones."""

from __future__ import annotations

import asyncio

import pytest
from fault_helpers import (
    Stream,
    complete,
    prompt_ids,
    role_metric,
    running,
    stream_completion,
    until,
)

from mooncake_testkit.role_procs import RoleCluster

pytestmark = pytest.mark.e2e


def resends(cluster: RoleCluster) -> float:
    """Prefill jobs the conductor re-sent because their instance died."""
    return role_metric(cluster, "conductor", "mooncake_conductor_prefill_resends",
                       'reason="died"')


async def test_prefill_killed_with_jobs_resends_them(cluster: RoleCluster) -> None:
    prompts = [prompt_ids(600, seed=20 + i) for i in range(3)]
    before = resends(cluster)
    outs = [Stream() for _ in prompts]
    tasks = [asyncio.create_task(stream_completion(cluster.url, p, 8, o))
             for p, o in zip(prompts, outs)]

    def busy_prefill() -> str | None:
        for item in running(cluster).values():
            if item["phase"] == "prefill" and str(item["instance_id"]).startswith("prefill-"):
                return str(item["instance_id"])
        return None

    victim: list[str] = []
    await until(lambda: victim.append(busy_prefill() or "") or victim[-1], 60,
                "a prefill job in flight")
    cluster[victim[-1]].kill()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert resends(cluster) >= before + 1
    # The same prompts again, nothing failing now: the very same greedy tokens.
    for prompt, result in zip(prompts, results):
        assert result.tokens == (await complete(cluster.url, prompt, 8)).tokens

    cluster[victim[-1]].start()
    cluster.wait_registered([victim[-1]], 120)


async def test_store_node_dies_replica_serves_and_lost_blocks_are_recomputed(
        cluster: RoleCluster) -> None:
    bt = 16
    warm = prompt_ids(200, seed=30)
    first = await complete(cluster.url, warm, 8)

    # Two replicas: with store-0 dead (the conductor has not noticed yet), the prefix still
    # comes from store-1, and nothing fails.
    cluster["store-0"].kill()
    again = await complete(cluster.url, warm, 8)
    assert again.tokens == first.tokens
    assert again.cached_tokens is not None and again.cached_tokens >= (200 - 1) // bt * bt

    # Blocks written now have one live home only, store-1: among them the ones decode writes
    # back for the output (no prefill instance holds those in its own cache).
    lonely = prompt_ids(60, seed=31)
    answer = await complete(cluster.url, lonely, 40)
    cluster["store-0"].start()
    cluster.wait_registered(["store-0"], 60)

    # store-1 dies holding the only copy: the follow-up turn recomputes what was lost.
    follow_up = lonely + answer.tokens + prompt_ids(10, seed=33)
    held = (len(lonely) + len(answer.tokens) - 1) // bt * bt  # written back before the death
    cluster["store-1"].kill()
    lost = await complete(cluster.url, follow_up, 8)
    assert lost.cached_tokens is not None and lost.cached_tokens < held
    # Asked again (its blocks are stored anew by now): cached, and the very same tokens.
    cached = await complete(cluster.url, follow_up, 8)
    assert cached.tokens == lost.tokens
    assert cached.cached_tokens is not None and cached.cached_tokens >= held

    cluster["store-1"].start()
    cluster.wait_registered(["store-1"], 60)
    # Both nodes are used again: new blocks land on each.
    await complete(cluster.url, prompt_ids(200, seed=32), 4)
    for node in ("store-0", "store-1"):
        assert role_metric(cluster, node, "mooncake_store_objects", 'tier="dram"') > 0


async def test_restarted_conductor_is_rejoined_and_remembers_the_store(
        cluster: RoleCluster) -> None:
    prompt = prompt_ids(120, seed=40)
    reference = await complete(cluster.url, prompt, 8)
    indexed = role_metric(cluster, "conductor", "mooncake_store_index_keys")
    cluster["conductor"].kill()
    cluster["conductor"].start()
    # Every instance registers again (its heartbeats get 404), store nodes re-report.
    cluster.wait_registered([n for n in cluster.procs if n != "conductor"], 120)
    await until(lambda: role_metric(cluster, "conductor", "mooncake_store_index_keys")
                >= indexed, 30, "store index rebuilt from the nodes' snapshots", poll_s=0.2)
    again = await complete(cluster.url, prompt, 8)
    assert again.tokens == reference.tokens
    assert again.cached_tokens is not None and again.cached_tokens >= 112
