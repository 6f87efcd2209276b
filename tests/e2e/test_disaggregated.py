"""`--role all` end to end on the real model: exact greedy output, prefix reuse, batching, errors."""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import time
from typing import TYPE_CHECKING

import httpx
import pytest
from openai import AsyncOpenAI

if TYPE_CHECKING:
    from mooncake_testkit.launcher import Cluster

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
_WORDS = ("river mountain engine protocol garden memory cache lattice harbor signal winter "
          "copper orbit meadow ledger tensor canyon beacon quartz violet thunder archive "
          "compass saddle ember glacier lantern mosaic nebula prairie").split()


def long_document(n_sentences: int, seed: int = 0) -> str:
    """Deterministic filler text (~12 tokens per sentence)."""
    rnd = random.Random(seed)
    return " ".join(" ".join(rnd.choice(_WORDS) for _ in range(9)).capitalize() + "."
                    for _ in range(n_sentences))


def chat(cluster: Cluster, messages: list[dict], max_tokens: int, **extra) -> dict:
    """One greedy chat completion with token ids returned."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids the chat template gives (what the server must tokenize too)."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def metric(cluster: Cluster, offset: int, name: str) -> float:
    """Read one sample from a role's /metrics."""
    text = httpx.get(cluster.role_url(offset) + "/metrics", headers=cluster.internal_headers,
                     timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


def metric_sum(cluster: Cluster, offset: int, name: str) -> float:
    """Sum of a labelled series over all its labels (0 when none was ever recorded)."""
    text = httpx.get(cluster.role_url(offset) + "/metrics", headers=cluster.internal_headers,
                     timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


DOC = long_document(85)
PROMPTS = [
    ("short", [{"role": "user", "content": "What is the capital of France?"}], 32),
    ("long", [{"role": "user", "content": "Read these notes.\n" + DOC +
               "\nWhich word appears first?"}], 24),
    ("multi-turn", [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Name a primary colour."},
                    {"role": "assistant", "content": "Red."},
                    {"role": "user", "content": "Name another one, and explain why."}], 40),
    ("code", [{"role": "user", "content": "Write a Python function that adds two numbers."}],
     48),
]


@pytest.mark.parametrize("name,messages,max_tokens", PROMPTS, ids=[p[0] for p in PROMPTS])
def test_greedy_output_equals_hf_generate(all_cluster, tokenizer, hf_greedy, name, messages,
                                          max_tokens) -> None:
    resp = chat(all_cluster, messages, max_tokens)
    prompt_ids = chat_ids(tokenizer, messages)
    expected = hf_greedy(prompt_ids, max_tokens)
    choice = resp["choices"][0]
    assert resp["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == expected
    assert choice["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert resp["usage"]["completion_tokens"] == len(expected)


def test_block_aligned_completion_prompt_equals_hf(all_cluster, hf_greedy) -> None:
    # 64 prompt tokens = exactly 4 blocks: no partial tail block crosses the wire.
    prompt = list(range(1000, 1064))
    r = httpx.post(all_cluster.url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(prompt, 16)


def test_second_turn_reuses_cached_prefix(all_cluster, tokenizer, hf_greedy) -> None:
    first = [{"role": "user", "content": "Here is a report.\n" + long_document(60, seed=3) +
              "\nSummarise it in one sentence."}]
    r1 = chat(all_cluster, first, 16)
    follow = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Now list three words from it."}]
    r2 = chat(all_cluster, follow, 24)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * (len(chat_ids(tokenizer, first)) // 16) - 16
    assert r2["choices"][0]["token_ids"] == hf_greedy(chat_ids(tokenizer, follow), 24)
    assert metric(all_cluster, 2, "mooncake_prefill_cached_tokens_total") >= cached


def test_eight_concurrent_streams_share_decode_steps(all_cluster, tokenizer, hf_greedy) -> None:
    client = AsyncOpenAI(base_url=all_cluster.url + "/v1", api_key="unused", max_retries=0)
    topics = ["the sea", "a robot", "autumn", "bread", "a city at night", "chess", "rain",
              "the moon"]
    messages = [[{"role": "user", "content": f"Write two sentences about {t}."}] for t in topics]

    async def one(msgs: list[dict]) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def all_of_them() -> list[tuple[str, int]]:
        try:
            return await asyncio.gather(*(one(m) for m in messages))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    for msgs, (text, n) in zip(messages, results):
        expected = hf_greedy(chat_ids(tokenizer, msgs), 40)
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        assert n == len(expected)
    assert metric(all_cluster, 3, "mooncake_engine_max_batch_size") > 1


def test_prompts_queued_behind_a_long_prefill_share_one_forward(all_cluster, tokenizer,
                                                                hf_greedy) -> None:
    """Short prompts arriving while a long one is prefilled are computed together, exactly."""
    url, headers = all_cluster.url, all_cluster.internal_headers
    long_msgs = [{"role": "user", "content": long_document(110, seed=31)}]
    shorts = [[{"role": "user", "content": f"Name a {thing} and say why."}]
              for thing in ("fruit", "bird", "tool", "city")]

    def body(msgs: list[dict], n: int) -> dict:
        return {"model": MODEL, "messages": msgs, "max_tokens": n, "temperature": 0}

    async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=300) as client:
            long_task = asyncio.create_task(
                client.post(url + "/v1/chat/completions", json=body(long_msgs, 4)))

            async def long_in_prefill() -> bool:
                r = await client.get(url + "/internal/requests", headers=headers)
                return any(item["phase"] == "prefill" for item in r.json())

            while not await long_in_prefill():
                assert not long_task.done(), long_task.result().text
                await asyncio.sleep(0.005)
            replies = await asyncio.gather(*(
                client.post(url + "/v1/chat/completions", json=body(m, 8)) for m in shorts))
            return await long_task, list(replies)

    def batches() -> tuple[float, float]:
        """(forward batches, batches of one job) the prefill instance ran so far."""
        return (metric(all_cluster, 2, "mooncake_prefill_batch_jobs_count"),
                metric(all_cluster, 2, 'mooncake_prefill_batch_jobs_bucket{le="1.0"}'))

    total0, single0 = batches()
    long_reply, replies = asyncio.run(scenario())
    total, single = batches()
    assert (total - total0) - (single - single0) >= 1  # at least two shorts in one pass
    for msgs, reply, n in zip([long_msgs, *shorts], [long_reply, *replies], [4, 8, 8, 8, 8]):
        assert reply.status_code == 200, reply.text
        expected = hf_greedy(chat_ids(tokenizer, msgs), n)
        assert reply.json()["choices"][0]["message"]["content"] == tokenizer.decode(
            expected, skip_special_tokens=True)


def test_kv_blocks_are_checksum_verified_on_read(all_cluster) -> None:
    chat(all_cluster, [{"role": "user", "content": long_document(10, seed=9)}], 4)
    assert metric(all_cluster, 3, "mooncake_decode_kv_blocks_verified_total") > 0
    assert metric_sum(all_cluster, 3, "mooncake_decode_failures_total") == 0


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL, "prompt": list(range(100, 8100)), "max_tokens": 500}, 400, None),
], ids=["malformed-json", "missing-messages", "bad-temperature", "n-9", "unknown-model",
        "context-overflow"])
def test_bad_input_gets_openai_error_and_server_keeps_serving(all_cluster, body, status,
                                                              param) -> None:
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else \
        "/v1/chat/completions"
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(all_cluster.url + path, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    if "prompt" in str(body)[:20] or (isinstance(body, dict) and "prompt" in body):
        assert "8000" in err["message"] and "500" in err["message"]
    ok = chat(all_cluster, [{"role": "user", "content": "Say yes."}], 4)
    assert ok["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_disconnect_frees_decode_blocks(all_cluster) -> None:
    free_before = metric(all_cluster, 3, "mooncake_engine_free_kv_blocks")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", all_cluster.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
            if got >= 5:
                break
    deadline = time.monotonic() + 30
    while True:
        running = metric(all_cluster, 3, "mooncake_engine_running")
        free = metric(all_cluster, 3, "mooncake_engine_free_kv_blocks")
        if running == 0 and free == free_before:
            break
        assert time.monotonic() < deadline, f"running={running} free={free}/{free_before}"
        time.sleep(0.2)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return ""


def _anon_huge_kb(pid: str) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.skipif("[madvise]" not in _thp_mode(), reason="THP is not in madvise mode here")
def test_every_role_runs_on_huge_pages(all_cluster) -> None:
    # glibc reads its tunables at start: the command line restarts itself with the huge-page
    # one, and the roles it starts inherit it (malloc_tuning.restart_with_huge_pages)
    pids = [str(all_cluster.proc.pid), *subprocess.run(
        ["pgrep", "-P", str(all_cluster.proc.pid)], capture_output=True, text=True).stdout.split()]
    assert len(pids) == 5
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in f.read().split(b"\0")
    # the engines' weights: hundreds of MB each, on 2 MB pages
    huge_mb = [_anon_huge_kb(pid) // 1024 for pid in pids]
    assert sum(mb > 100 for mb in huge_mb) >= 2, huge_mb


def test_ctrl_c_stops_every_role(all_cluster) -> None:
    children = subprocess.run(["pgrep", "-P", str(all_cluster.proc.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 4
    assert all_cluster.stop() == 0
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0
    for offset in range(4):
        with pytest.raises(httpx.ConnectError):
            httpx.get(all_cluster.role_url(offset) + "/health", timeout=2)
