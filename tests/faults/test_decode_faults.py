"""Decode faults on the real model: an instance SIGKILLed mid-stream, a request moved on purpose,
an instance that stops answering, one drained by SIGTERM. Each time the client's stream must
equal the uninterrupted greedy output token for token: nothing lost, nothing repeated."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from fault_helpers import (
    Stream,
    complete,
    prompt_ids,
    role_metric,
    running,
    serving,
    stream_completion,
    until,
)

from mooncake_testkit.role_procs import RoleCluster

pytestmark = pytest.mark.e2e

MAX_TOKENS = 64
DECODES = ("decode-0", "decode-1")


def other(name: str) -> str:
    """The other decode instance."""
    return DECODES[1 - DECODES.index(name)]


async def start_stream(cluster: RoleCluster, prompt: list[int], after_tokens: int,
                       max_tokens: int = MAX_TOKENS) -> tuple[asyncio.Task[Stream], Stream, str]:
    """Start a streamed completion; return once `after_tokens` arrived, with the decode
    instance serving it."""
    out = Stream()
    task = asyncio.create_task(stream_completion(cluster.url, prompt, max_tokens, out))
    await until(lambda: len(out.tokens) >= after_tokens or task.done(), 60, "tokens flowing")
    assert not task.done(), "the request ended before the fault"
    victim = serving(cluster, out.request_id)
    assert victim in DECODES, running(cluster)
    return task, out, victim


def moves(cluster: RoleCluster, reason: str) -> float:
    """The conductor's count of decode moves for `reason`."""
    return role_metric(cluster, "conductor", "mooncake_conductor_decode_moves",
                       f'reason="{reason}"')


async def test_decode_killed_mid_stream_continues_elsewhere_exactly(
        cluster: RoleCluster) -> None:
    prompt = prompt_ids(40, seed=1)
    reference = (await complete(cluster.url, prompt, MAX_TOKENS)).tokens
    assert len(reference) == MAX_TOKENS
    died_before = moves(cluster, "died")

    task, _out, victim = await start_stream(cluster, prompt, after_tokens=30)
    loaded_before = role_metric(cluster, other(victim), "mooncake_decode_moved_in_loaded_tokens")
    cluster[victim].kill()
    result = await asyncio.wait_for(task, 60)

    assert result.tokens == reference  # no token lost, none repeated, same greedy output
    assert result.finish_reason == "length"
    assert moves(cluster, "died") == died_before + 1
    # The survivor loaded KV the victim had written back (beyond the prompt's blocks).
    loaded = role_metric(cluster, other(victim), "mooncake_decode_moved_in_loaded_tokens")
    assert loaded - loaded_before > len(prompt)

    # Restarted, it registers again and takes work again.
    cluster[victim].start()
    cluster.wait_registered([victim], 120)
    before = role_metric(cluster, victim, "mooncake_engine_generated_tokens")
    outs = await asyncio.gather(*[stream_completion(cluster.url, prompt_ids(20, seed=s), 16)
                                  for s in range(3)])
    assert all(len(o.tokens) == 16 for o in outs)
    assert role_metric(cluster, victim, "mooncake_engine_generated_tokens") > before


async def test_migrate_on_purpose_moves_a_running_request(cluster: RoleCluster) -> None:
    prompt = prompt_ids(36, seed=2)
    reference = (await complete(cluster.url, prompt, MAX_TOKENS)).tokens
    ordered_before = moves(cluster, "ordered")

    task, out, source = await start_stream(cluster, prompt, after_tokens=25)
    target = other(source)
    moved_in_before = role_metric(cluster, target, "mooncake_decode_moved_in")
    loaded_before = role_metric(cluster, target, "mooncake_decode_moved_in_loaded_tokens")
    async with httpx.AsyncClient(headers=cluster.headers) as http:
        r = await http.post(cluster.url + "/internal/migrate",
                            json={"request_id": out.request_id, "target": target})
        assert r.status_code == 200, r.text
        assert r.json() == {"request_id": out.request_id, "source": source, "target": target}
        await until(lambda: serving(cluster, out.request_id) in (target, None), 10,
                    "request on the target")
        # Unknown requests and dead targets are refused, not guessed at.
        assert (await http.post(cluster.url + "/internal/migrate",
                                json={"request_id": "nope"})).status_code == 404
        assert (await http.post(cluster.url + "/internal/migrate", json={})).status_code == 400
    result = await asyncio.wait_for(task, 60)

    assert result.tokens == reference
    assert moves(cluster, "ordered") == ordered_before + 1
    assert role_metric(cluster, target, "mooncake_decode_moved_in") == moved_in_before + 1
    loaded = role_metric(cluster, target, "mooncake_decode_moved_in_loaded_tokens")
    assert loaded - loaded_before > len(prompt)  # blocks written back by the source


async def test_migrate_needs_the_cluster_secret(cluster: RoleCluster) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(cluster.url + "/internal/migrate", json={"request_id": "x"})
        assert r.status_code == 401
        assert (await http.get(cluster.url + "/internal/requests")).status_code == 401


async def test_written_back_blocks_serve_a_follow_up_turn(cluster: RoleCluster) -> None:
    prompt = prompt_ids(40, seed=3)
    first = await complete(cluster.url, prompt, 48)
    follow_up = prompt + first.tokens + prompt_ids(8, seed=4)
    second = await complete(cluster.url, follow_up, 4)
    bt = 16
    # Every full block of prompt + output but the last token's was written back by decode.
    assert second.cached_tokens is not None
    assert second.cached_tokens >= (len(prompt) + len(first.tokens) - 1) // bt * bt
    assert second.cached_tokens > len(prompt) // bt * bt


async def test_stalled_decode_is_routed_around_and_its_stream_moves(
        cluster: RoleCluster) -> None:
    prompt = prompt_ids(30, seed=5)
    reference = (await complete(cluster.url, prompt, MAX_TOKENS)).tokens
    stalled_before = moves(cluster, "stalled")

    task, _out, victim = await start_stream(cluster, prompt, after_tokens=20)
    cluster[victim].signal(signal.SIGSTOP)  # alive to the kernel, silent to everyone
    try:
        result = await asyncio.wait_for(task, 60)
        assert result.tokens == reference
        assert moves(cluster, "stalled") == stalled_before + 1
        # While it misses heartbeats, new requests go to the other instance only.
        assert victim not in {s["info"]["instance_id"] for s in cluster.instances()
                              if s["alive"]}
        fresh = await stream_completion(cluster.url, prompt_ids(20, seed=6), 8)
        assert len(fresh.tokens) == 8
    finally:
        cluster[victim].signal(signal.SIGCONT)
    cluster.wait_registered([victim], 30)  # heartbeats again: back in the rotation


async def test_sigterm_drains_running_streams_and_takes_no_new_work(
        cluster: RoleCluster) -> None:
    prompt = prompt_ids(30, seed=7)
    reference = (await complete(cluster.url, prompt, MAX_TOKENS)).tokens
    moves_before = sum(moves(cluster, r) for r in ("died", "stalled", "error", "refused"))

    task, out, victim = await start_stream(cluster, prompt, after_tokens=10)
    cluster[victim].signal(signal.SIGTERM)
    await until(lambda: any(s["info"]["instance_id"] == victim and s["draining"]
                            for s in cluster.instances()), 10, "instance draining")
    # New work goes elsewhere while the running stream goes on where it is.
    fresh_out = Stream()
    fresh = asyncio.create_task(stream_completion(cluster.url, prompt_ids(20, seed=8), 30,
                                                  fresh_out))
    await until(lambda: fresh_out.tokens or fresh.done(), 30, "fresh request decoding")
    assert serving(cluster, fresh_out.request_id) in (other(victim), None)
    assert serving(cluster, out.request_id) in (victim, None)
    assert len((await asyncio.wait_for(fresh, 60)).tokens) == 30
    result = await asyncio.wait_for(task, 60)
    assert result.tokens == reference
    assert sum(moves(cluster, r) for r in ("died", "stalled", "error", "refused")) == moves_before
    assert await asyncio.to_thread(cluster[victim].wait, 30) == 0  # then it exits cleanly
    assert victim not in {s["info"]["instance_id"] for s in cluster.instances()}

    cluster[victim].start()
    cluster.wait_registered([victim], 120)
