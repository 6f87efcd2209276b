"""scripts/replay_trace.py and mooncake_bench: trace -> prompts keeps the prefix structure; the
statistics."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from mooncake_bench import systems
from mooncake_bench import trace as bench_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "mooncake_sample.jsonl"  # the first 300 lines of the paper's trace


@pytest.fixture(scope="module")
def rt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("replay_trace", ROOT / "scripts" /
                                                  "replay_trace.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["replay_trace"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def req(rt: ModuleType, hash_ids: list[int], input_length: int, ts: float = 0.0):
    return rt.TraceRequest(ts, input_length, 4, tuple(hash_ids))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_hash_prefixes_give_identical_token_prefixes(rt: ModuleType) -> None:
    b = rt.PromptBuilder(16)
    x = b.prompt(req(rt, [1, 2, 3, 4], 4 * 512))
    y = b.prompt(req(rt, [1, 2, 3, 9, 10], 5 * 512))
    z = b.prompt(req(rt, [7, 2, 3], 3 * 512))
    assert x[:48] == y[:48] and x[48:64] != y[48:64]
    assert common_prefix(x, z) < 16  # different first block: nothing shared as a prefix
    # The same request maps to the same prompt in another builder with the same seed.
    assert rt.PromptBuilder(16).prompt(req(rt, [1, 2, 3, 4], 2048)) == x
    assert rt.PromptBuilder(16, seed=1).prompt(req(rt, [1, 2, 3, 4], 2048)) != x


def test_lengths_scale_with_the_partial_last_block(rt: ModuleType) -> None:
    b = rt.PromptBuilder(32)
    assert len(b.prompt(req(rt, [1, 2, 3], 3 * 512))) == 96
    assert len(b.prompt(req(rt, [1, 2, 3], 2 * 512 + 256))) == 64 + 16
    assert len(b.prompt(req(rt, [1], 1))) == 1  # never empty
    # A shorter request sharing the blocks is an exact prefix of the longer one.
    long = b.prompt(req(rt, [1, 2, 3], 3 * 512))
    short = b.prompt(req(rt, [1, 2, 3], 2 * 512 + 100))
    assert long[:len(short)] == short
    assert all(1000 <= t < 40000 for t in long)


def test_real_trace_prefix_sharing_is_preserved(rt: ModuleType) -> None:
    trace = rt.load_trace(TRACE, 0, 300)
    assert len(trace) == 300
    b = rt.PromptBuilder(16)
    prompts = [b.prompt(r, i) for i, r in enumerate(trace)]
    shared_pairs = 0
    for i in range(len(trace)):
        for j in range(i + 1, len(trace)):
            hi, hj = trace[i].hash_ids, trace[j].hash_ids
            k = 0
            while k < min(len(hi), len(hj)) and hi[k] == hj[k]:
                k += 1
            full = min(k, len(hi) - 1, len(hj) - 1)  # blocks complete in both prompts
            assert common_prefix(prompts[i], prompts[j]) >= full * 16
            if k == 0:
                assert common_prefix(prompts[i], prompts[j]) < 16
            shared_pairs += k > 0
        assert len(prompts[i]) == b.length(trace[i])
    assert shared_pairs > 10  # the slice does exercise sharing


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps(rt: ModuleType) -> None:
    times = [0.0, 0.9]  # the hand-off to decode, then 20 decode gaps
    for gap in [0.1] * 18 + [1.0, 2.0]:  # the longest 10% are 2.0 and 1.0
        times.append(times[-1] + gap)
    assert bench_trace.request_tbt(times) == pytest.approx(1.5)
    assert bench_trace.request_tbt([0.0, 0.5, 0.8]) == pytest.approx(0.3)
    assert bench_trace.request_tbt([0.0, 0.3]) is None  # its only gap is the hand-off
    assert bench_trace.second_token_within([1.0, 1.4], ttft_slo=1.0, tbt_slo=0.5)
    assert not bench_trace.second_token_within([1.0, 1.6], ttft_slo=1.0, tbt_slo=0.5)


def test_percentiles_interpolate(rt: ModuleType) -> None:
    values = list(range(1, 101))
    assert bench_trace.percentile(values, 50) == pytest.approx(50.5)
    assert bench_trace.percentile(values, 99) == pytest.approx(99.01)
    assert math.isnan(bench_trace.percentile([], 50))


def test_summary_counts_slo_attainment_rejections_and_hits(rt: ModuleType) -> None:
    O = rt.Outcome
    outcomes = [
        O("ok", ttft_s=0.5, token_times=[0.5, 0.6, 0.7], prompt_tokens=100, cached_tokens=50),
        O("ok", ttft_s=3.0, token_times=[3.0, 3.1], prompt_tokens=100, cached_tokens=0),  # TTFT
        O("ok", ttft_s=0.2, token_times=[0.2, 0.4, 1.4], prompt_tokens=100,  # TBT
          cached_tokens=50),
        O("ok", ttft_s=0.2, token_times=[0.2, 1.8], prompt_tokens=100),  # second token
        O("rejected"),
        O("error", error="boom"),
    ]
    s = rt.summarize(outcomes, ttft_slo=1.0, tbt_slo=0.5)
    assert (s.requests, s.ok, s.rejected, s.errors) == (6, 4, 1, 1)
    assert s.cache_hit_rate == pytest.approx(100 / 400)
    assert s.computed_tokens_per_request == pytest.approx(300 / 4)
    assert s.within_slo == pytest.approx(1 / 6)
    assert s.accepted_within_slo == pytest.approx(1 / 5)
    assert s.ttft_p50 == pytest.approx(0.35)


async def test_send_reads_a_stream_and_recognises_429(rt: ModuleType) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["ignore_eos"] is True and body["max_tokens"] == 2
        if body["prompt"] == [1]:
            return httpx.Response(429, headers={"Retry-After": "2"},
                                  json={"error": {"message": "overloaded"}})
        chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": 2}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        ok = await rt.send(client, "http://x", "m", [5, 6, 7], 2)
        rejected = await rt.send(client, "http://x", "m", [1], 2)
    assert ok.status == "ok" and len(ok.token_times) == 2 and ok.cached_tokens == 2
    assert ok.ttft_s == ok.token_times[0]
    assert rejected.status == "rejected"


def test_unknown_launch_spec_is_a_clear_error(rt: ModuleType, tmp_path: Path) -> None:
    with (pytest.raises(ValueError, match="--launch: unknown configuration"),
          systems.launch("three-nodes", [], [], tmp_path)):
        pass
