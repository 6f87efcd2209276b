"""scripts/bench_serving.py: request bodies, stream parsing, figures, targets (no servers)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import httpx
import pytest

from mooncake_bench import client as bench_client
from mooncake_bench import machine, report, workloads
from mooncake_bench import trace as bench_trace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "scripts" /
                                                  "bench_serving.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
"""


def test_cpu_info_reads_model_and_flags(bs: ModuleType) -> None:
    info = machine.cpu_info(CPUINFO)
    assert info["model"] == "Intel(R) Xeon(R) Processor"
    assert info["flags"]["avx2"] and info["flags"]["avx512_bf16"]
    assert not info["flags"]["amx_bf16"]
    assert machine.cpu_info("")["model"] == "unknown"


def test_ratio_handles_missing_and_zero(bs: ModuleType) -> None:
    assert bs.ratio(3.0, 2.0) == pytest.approx(1.5)
    assert math.isnan(bs.ratio(None, 2.0)) and math.isnan(bs.ratio(1.0, float("nan")))
    assert bs.ratio(1.0, 0.0) == math.inf  # the baseline served nothing within SLO
    assert math.isnan(bs.ratio(0.0, 0.0))


def test_target_verdicts_and_lines(bs: ModuleType) -> None:
    T = bs.Target
    assert T("a", 0.7, "<=", 0.8).verdict == "PASS"
    assert T("a", 0.9, "<=", 0.8).verdict == "FAIL"
    assert T("a", math.inf, ">=", 1.5).verdict == "PASS"
    assert T("a", float("nan"), ">=", 1.5).verdict == "n/a"
    assert T("x / y", 0.62, "<=", 0.8).line() == "[PASS] x / y: 0.62x (target <= 0.8x)"
    assert T("share", 0.97, ">=", 0.95, unit="%").line() == \
        "[PASS] share: 97.0% (target >= 95%)"


class FakePrompts:
    def text(self, ids: list[int]) -> str:
        return "".join(f" w{i}" for i in ids)


def test_bodies_ask_each_server_for_exact_lengths_its_way(bs: ModuleType) -> None:
    moon = bench_client.completion_body(bench_client.Api("mooncake", "http://x", "m"), [5, 6], 7)
    assert moon["prompt"] == [5, 6] and moon["ignore_eos"] is True
    assert moon["max_tokens"] == 7 and moon["stream"] and moon["temperature"] == 0
    assert "generation_config" not in moon
    tf_api = bench_client.Api("tfserve", "http://x", "/m", FakePrompts())
    tf = bench_client.completion_body(tf_api, [5, 6], 7)
    assert tf["prompt"] == " w5 w6" and "ignore_eos" not in tf and "stream_options" not in tf
    # A JSON string: transformers serve json.loads() it.
    assert json.loads(tf["generation_config"]) == {"max_new_tokens": 7, "eos_token_id": -1}


def sse(chunks: list[dict], done: bool = True) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + (
        "data: [DONE]\n\n" if done else "")


async def test_send_counts_text_chunks_as_tokens(bs: ModuleType) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["prompt"] == [1]:
            return httpx.Response(429, json={"error": {"message": "overloaded"}})
        if body["prompt"] == [2]:
            return httpx.Response(422, json={"detail": "Unexpected fields"})
        if body["prompt"] == [3]:
            return httpx.Response(200, text=sse([{"choices": [{"text": "a"}]},
                                                 {"error": "boom"}]))
        if body["prompt"] == [4]:  # cut off: no finish_reason
            return httpx.Response(200, text=sse([{"choices": [{"text": "a"}]}], done=False))
        if isinstance(body["prompt"], str):  # transformers serve: empty finish chunk + usage
            return httpx.Response(200, text=sse([
                {"choices": [{"text": " a"}]}, {"choices": [{"text": " b"}]},
                {"choices": [{"text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 2, "completion_tokens": 2}}], done=False))
        return httpx.Response(200, text=sse([  # mooncake: last text rides the finish chunk
            {"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 1}}}]))

    moon = bench_client.Api("mooncake", "http://x", "m")
    tf = bench_client.Api("tfserve", "http://x", "m", FakePrompts())
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        m = await bench_client.send(client, moon, [7, 8], 2)
        t = await bench_client.send(client, tf, [7, 8], 2)
        rejected = await bench_client.send(client, moon, [1], 2)
        unprocessable = await bench_client.send(client, moon, [2], 2)
        failed = await bench_client.send(client, moon, [3], 2)
        cut = await bench_client.send(client, moon, [4], 2)
    for r in (m, t):
        assert r.status == "ok" and len(r.token_times) == 2 and r.completion_tokens == 2
        assert r.ttft_s == r.token_times[0] and r.finished
    assert m.cached_tokens == 1
    assert rejected.status == "rejected"
    assert unprocessable.status == "error" and "422" in unprocessable.error
    assert failed.status == "error" and failed.error == "boom"
    assert cut.status == "error" and "finish_reason" in cut.error


def result(bs: ModuleType, times: list[float], status: str = "ok", tokens: int | None = None):
    n = len(times) if tokens is None else tokens
    return bench_client.Result(status, ttft_s=times[0] if times else None, token_times=times,
                     requested_tokens=len(times), completion_tokens=n)


def test_concurrent_summary_pools_gaps_and_per_request_tbt(bs: ModuleType) -> None:
    results = [result(bs, [1.0, 1.1, 1.2, 1.3]),  # gaps 0.1
               result(bs, [2.0, 2.5, 3.0, 3.5]),  # gaps 0.5
               result(bs, [0.5, 0.6, 0.7, 0.8], tokens=3),  # gaps 0.1, one token short
               result(bs, [], status="error")]
    s = workloads.concurrent_summary(results, wall_s=4.0)
    assert (s["requests"], s["ok"], s["errors"], s["short"]) == (4, 3, 1, 1)
    assert s["output_tokens"] == 11 and s["output_tok_s"] == pytest.approx(11 / 4)
    assert s["tbt_p50_gaps"] == pytest.approx(0.1)  # 6 gaps of 0.1, 3 of 0.5
    assert s["tbt_p50_per_request"] == pytest.approx(0.1)  # per request 0.1, 0.5, 0.1
    assert s["ttft_p50"] == pytest.approx(1.0)


def test_targets_from_results(bs: ModuleType) -> None:
    results = {
        "tfserve": {"ttft": {"256": {"ttft_p50": 1.0}},
                    "concurrent": {"output_tok_s": 100.0, "tbt_p50_gaps": 0.1,
                                   "tbt_p50_per_request": 0.2},
                    "replay": {"within_slo": 0.4, "accepted_within_slo": 0.4}},
        "colocated": {"ttft": {"256": {"ttft_p50": 0.5}},
                      "concurrent": {"output_tok_s": 140.0, "tbt_p50_gaps": 0.08,
                                     "tbt_p50_per_request": 0.1},
                      "replay": {"within_slo": 0.5}},
        "all": {"ttft": {"256": {"ttft_p50": 0.6}},
                "concurrent": {"output_tok_s": 160.0, "tbt_p50_gaps": 0.12},
                "replay": {"within_slo": 0.7, "accepted_within_slo": 0.96}},
    }
    got = {t.name: t for t in bs.targets(results, [256, 1024])}
    assert got["TTFT @256 colocated / tfserve"].verdict == "PASS"  # 0.5x
    assert got["TTFT @256 all / colocated"].verdict == "FAIL"  # 1.2x
    assert got["TTFT @1024 all / colocated"].verdict == "n/a"  # not measured
    assert got["concurrent output tok/s all / tfserve"].verdict == "PASS"  # 1.6x
    assert got["concurrent output tok/s colocated / tfserve"].verdict == "FAIL"  # 1.4x
    assert got["concurrent TBT p50 (all gaps) all / tfserve"].verdict == "FAIL"  # 1.2x
    assert got["concurrent TBT p50 (all gaps) colocated / tfserve"].verdict == "PASS"
    assert got["replay effective capacity all / tfserve"].value == pytest.approx(1.75)
    assert got["replay effective capacity all / colocated"].verdict == "PASS"  # 1.4x
    assert got["replay: all's accepted requests within both SLOs"].verdict == "PASS"
    # A system that did not run: its ratios are n/a, not a crash.
    partial = {t.name: t for t in bs.targets({"all": results["all"]}, [256])}
    assert partial["replay effective capacity all / tfserve"].verdict == "n/a"


def test_replay_summary_counts_capacity(bs: ModuleType) -> None:
    results = [result(bs, [0.5, 0.6]), result(bs, [6.0, 6.1]),  # 2nd: TTFT above 5 s
               bench_client.Result("rejected"), bench_client.Result("error", error="x")]
    s = workloads.replay_summary(results, ttft_slo=5.0, tbt_slo=0.2, wall_s=10.0)
    assert s["within_slo_count"] == 1 and s["within_slo"] == pytest.approx(0.25)
    assert s["accepted_within_slo"] == pytest.approx(1 / 3)
    assert (s["rejected"], s["errors"], s["wall_s"]) == (1, 1, 10.0)


def test_quick_fills_defaults_and_flags_win(bs: ModuleType) -> None:
    args = bs.resolve_args(["--quick", "--model", "/m", "--concurrency", "8"])
    assert args.ttft_sizes == "64" and args.max_requests == 10 and args.concurrency == 8
    full = bs.resolve_args(["--model", "/m", "--systems", "tfserve,all"])
    assert full.ttft_sizes == "256,1024,4096" and full.concurrency == 16
    assert full.systems == ["tfserve", "all"]
    with pytest.raises(SystemExit):
        bs.resolve_args(["--model", "/m", "--systems", "vllm"])


def test_json_safe_turns_nan_into_null(bs: ModuleType) -> None:
    doc = report.json_safe({"a": float("nan"), "b": [1.0, float("inf")], 3: {"c": 2}})
    assert json.loads(json.dumps(doc, allow_nan=False)) == {"a": None, "b": [1.0, None],
                                                            "3": {"c": 2}}


class StubTokenizer:
    """A vocabulary where "Ġbad" decodes to a word that encodes as two tokens."""

    vocab: ClassVar[dict[str, int]] = {"Ġcat": 1001, "Ġdog": 1002, "Ġbad": 1003, "cat": 1004, "Ġ9": 1005, "Ġlow": 5}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def decode(self, ids: list[int]) -> str:
        back = {v: k.replace("Ġ", " ") for k, v in self.vocab.items()}
        return "".join(back[i] for i in ids)

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[99, 98] if text == " bad" else
                               [self.vocab["Ġ" + w] for w in text.split()])


def test_word_token_ids_keep_only_round_tripping_words(bs: ModuleType) -> None:
    assert bench_client.word_token_ids(StubTokenizer()) == [1001, 1002]


def _model_dir() -> Path | None:
    try:
        from mooncake_server.model_assets import DEFAULT_MODEL_NAME, default_cache_dir
    except ImportError:
        return None
    path = default_cache_dir() / "models" / DEFAULT_MODEL_NAME
    return path if (path / "tokenizer.json").exists() else None


@pytest.mark.skipif(_model_dir() is None, reason="default model not converted yet")
def test_word_prompts_round_trip_through_the_real_tokenizer(bs: ModuleType) -> None:
    prompts = bench_client.Prompts(_model_dir())
    assert len(prompts.ids) > 10000
    for n, seed in ((1, "a"), (257, "b"), (4096, "c")):
        ids = prompts.random(n, seed)
        assert len(ids) == n and prompts.round_trips(ids)
    assert prompts.random(64, "x") == prompts.random(64, "x") != prompts.random(64, "y")
    # Trace prompts keep replay_trace's shared prefixes after the mapping to words.
    b = prompts.builder(16, 0)
    rt = bench_trace
    x = prompts.trace_prompt(b, rt.TraceRequest(0, 3 * 512, 4, (1, 2, 3)), 0)
    y = prompts.trace_prompt(b, rt.TraceRequest(0, 3 * 512, 4, (1, 2, 9)), 1)
    assert x[:32] == y[:32] and x[32:] != y[32:] and prompts.round_trips(x)
