"""The whole request path with prefill-local caches, reuse policies, layer-wise KV streaming and
decode admission: real role apps in one process, a tiny random model, KV over TCP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from live_cluster import BLOCK, Cluster, start

from mooncake_server.block_keys import block_keys, kv_namespace
from mooncake_server.wire.jobs import PrefillJob, PrefillResult, SamplingParams


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str) -> Iterator[Cluster]:
    c = start(tiny_model_dir, policy="cache-global")
    try:
        yield c
    finally:
        c.stop()


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def prefill(c: Cluster, which: int, ids: list[int], reuse: str, rid: str) -> PrefillResult:
    """One prefill job sent straight to prefill-`which`."""
    job = PrefillJob(request_id=rid, prompt_token_ids=ids,
                     block_keys=block_keys(ids, BLOCK, kv_namespace("tiny", "float32", BLOCK)),
                     sampling=SamplingParams(max_tokens=1, temperature=0.0),
                     reuse=reuse)
    r = httpx.post(c.prefill[which] + "/internal/prefill", content=job.model_dump_json(),
                   headers={**c.headers, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    lines = r.text.splitlines()  # the first tokens as soon as computed, then the result
    assert len(lines) == 2, lines
    return PrefillResult.model_validate_json(lines[-1])


def complete(c: Cluster, ids: list[int], max_tokens: int = 6) -> httpx.Response:
    return httpx.post(c.conductor + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_reuse_local_global_none_on_two_prefill_instances(cluster: Cluster) -> None:
    shared = prompt(1, 12)  # 3 blocks
    ids = shared + [5, 6, 7]
    cold = prefill(cluster, 0, ids, "global", "a")
    assert cold.cached_tokens == 0
    # The same instance again: its own cache has the prefix.
    again = prefill(cluster, 0, shared + [8, 9], "local", "b")
    assert (again.cached_tokens, again.local_cached_tokens) == (12, 12)
    # The other instance, local only: it holds nothing, it computes everything.
    assert prefill(cluster, 1, ids, "local", "c").cached_tokens == 0
    assert prefill(cluster, 0, ids, "none", "d").cached_tokens == 0
    # A prefix only the store has (written by prefill-0): `global` fetches it.
    other = prompt(2, 12) + [1, 2, 3]
    made = prefill(cluster, 0, other, "none", "e")
    fetched = prefill(cluster, 1, other, "global", "f")
    assert (fetched.cached_tokens, fetched.local_cached_tokens) == (12, 0)
    # Fetched, layer-streamed (prefill-0) and written-after (prefill-1) KV are the same bytes.
    assert fetched.first_token == made.first_token
    assert fetched.block_checksums[:3] == made.block_checksums[:3]
    full = prefill(cluster, 1, ids, "none", "g")
    assert full.block_checksums == cold.block_checksums and full.first_token == cold.first_token


def test_layer_streamed_blocks_reach_decode_intact_and_cached_output_is_the_same(
        cluster: Cluster) -> None:
    verified = cluster.metric(cluster.decode, "mooncake_decode_kv_blocks_verified_total")
    recomputed = cluster.metric(cluster.decode, "mooncake_decode_recomputed_tokens_total")
    streamed = cluster.metric(cluster.prefill[0], "mooncake_prefill_jobs_total")
    ids = prompt(3, 21)  # 5 full blocks + a tail
    first = complete(cluster, ids)
    assert first.status_code == 200, first.text
    # Both idle and nothing cached: the tie goes to prefill-0, the layer-wise one.
    assert cluster.metric(cluster.prefill[0], "mooncake_prefill_jobs_total") == streamed + 1
    assert cluster.metric(cluster.decode,
                          "mooncake_decode_kv_blocks_verified_total") == verified + 6
    assert cluster.metric(cluster.decode,
                          "mooncake_decode_recomputed_tokens_total") == recomputed
    second = complete(cluster, ids)
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 20
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_the_conductor_sees_what_each_prefill_instance_caches(cluster: Cluster) -> None:
    def view() -> dict[str, int]:
        return httpx.get(cluster.conductor + "/internal/prefill-cache/index",
                         headers=cluster.headers, timeout=5).json()

    before = view()
    shared = prompt(4, 16)
    prefill(cluster, 1, shared + [9], "none", "warm")  # 4 new full blocks on prefill-1
    # Reported before the job's result returned: no waiting.
    assert view()["prefill-1"] == before["prefill-1"] + 4
    assert view()["prefill-0"] == before["prefill-0"]
    r = complete(cluster, shared + [10, 11])  # its own cache, or fetched from the store
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_a_decode_instance_without_room_means_an_early_429(cluster: Cluster) -> None:
    jobs = cluster.metric(cluster.prefill[0], "mooncake_prefill_jobs_total") + cluster.metric(
        cluster.prefill[1], "mooncake_prefill_jobs_total")
    held = []
    try:
        for rid in ("hold-1", "hold-2"):  # each may need the whole context: 32 of 64 blocks
            r = httpx.post(cluster.decode + "/internal/decode/reserve", headers=cluster.headers,
                           json={"request_id": rid, "prompt_tokens": 100, "max_tokens": 28})
            assert r.status_code == 200, r.text
            held.append(rid)
        r = complete(cluster, prompt(5, 10))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "KV memory" in r.json()["error"]["message"]
        after = cluster.metric(cluster.prefill[0], "mooncake_prefill_jobs_total") + \
            cluster.metric(cluster.prefill[1], "mooncake_prefill_jobs_total")
        assert after == jobs  # refused before any prefill work
    finally:
        for rid in held:
            httpx.post(cluster.decode + "/internal/decode/release", headers=cluster.headers,
                       json={"request_id": rid})
    assert complete(cluster, prompt(5, 10)).status_code == 200
