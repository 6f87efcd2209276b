"""`--dtype auto` (the default) end to end: one answer per prompt, whatever the start, the batch
or the roles. Its distance from float32 is bounded in tests/engine/test_quality.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_disaggregated import MODEL

from mooncake_server.model_assets import default_cache_dir
from mooncake_testkit.launcher import Cluster, start_cluster

pytestmark = pytest.mark.e2e

TOPICS = ["the sea", "a robot", "autumn", "bread", "a city at night", "chess", "rain",
          "the moon", "a library", "trains", "honey bees", "winter", "a violin", "the desert",
          "a lighthouse", "coffee"]
PROMPTS = [[{"role": "user", "content": f"Tell me something about {t}."}] for t in TOPICS]
TOKENS = 32


def _fresh_cache(root: Path) -> Path:
    """An empty cache folder sharing only the converted model: a first start on a machine."""
    root.mkdir()
    (root / "models").symlink_to(default_cache_dir() / "models")
    return root


def _start(role: str, cache: Path) -> Cluster:
    """`--role ROLE --dtype auto` whose cache is `cache`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONCAKE_CACHE_DIR", str(cache))
        return start_cluster(role, ["--dtype", "auto"])


async def _answer(client: httpx.AsyncClient, cluster: Cluster, messages: list[dict],
                  ) -> list[int]:
    """One greedy completion of exactly TOKENS tokens, as token ids."""
    body = {"model": MODEL, "messages": messages, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = await client.post(cluster.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _one_by_one(cluster: Cluster) -> list[list[int]]:
    """Each prompt alone: nothing shares its prefill pass or decode steps."""
    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return [await _answer(client, cluster, m) for m in PROMPTS]
    return asyncio.run(run())


def _all_at_once(cluster: Cluster) -> list[list[int]]:
    """All prompts sent together: they share prefill passes and decode steps."""
    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(_answer(client, cluster, m) for m in PROMPTS)))
    return asyncio.run(run())


@pytest.fixture(scope="module")
def colocated_answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """A first start of `--role colocated --dtype auto`: the prompts alone, then batched."""
    cluster = _start("colocated", _fresh_cache(tmp_path_factory.mktemp("a") / "cache"))
    try:
        alone = _one_by_one(cluster)
        batched = _all_at_once(cluster)
        batch_peak = _metric(cluster, "mooncake_engine_max_batch_size")
    finally:
        cluster.stop()
    yield alone, batched, batch_peak


def _metric(cluster: Cluster, name: str) -> float:
    """A gauge's value on the cluster's own /metrics."""
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    return max(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_a_prompt_gets_the_same_tokens_alone_or_in_a_batch_of_16(colocated_answers) -> None:
    alone, batched, batch_peak = colocated_answers
    assert batch_peak > 1  # the prompts did share steps
    assert [len(a) for a in alone] == [TOKENS] * len(PROMPTS)
    assert batched == alone


def test_two_cold_starts_give_the_same_answers(colocated_answers, tmp_path) -> None:
    """A second first start (its own empty cache) runs the same kernels: the same tokens."""
    cluster = _start("colocated", _fresh_cache(tmp_path / "cache"))
    try:
        again = _all_at_once(cluster)
    finally:
        cluster.stop()
    assert again == colocated_answers[0]


def test_disaggregation_never_changes_an_answer(colocated_answers, tmp_path) -> None:
    """`--role all` (prefill and decode in their own processes, KV through the store) answers
    as the colocated engine does, token for token, in the default mode."""
    cluster = _start("all", _fresh_cache(tmp_path / "cache"))
    try:
        disaggregated = _all_at_once(cluster)
    finally:
        cluster.stop()
    assert disaggregated == colocated_answers[0]
