"""Log-probabilities, echo and n > 1 served for real: a colocated engine and a disaggregated
cluster (prefill + decode + store behind a conductor) over a tiny random Llama in float32.

Every log-probability is checked against `log_softmax` of HF's own logits for the same tokens,
computed here in one plain forward over the whole sequence.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from tiny_served import tiny_clusters
from transformers import AutoModelForCausalLM

from mooncake_server.wire.auth import secret_headers

SECRET = "logprobs-secret"
# 40 token ids: two full 16-token blocks and a partial one (a cached prefix is possible).
PROMPT = [504, 3458, 282, 4053, 314, 2113, 30, 378, 1390, 282, 1017, 2203, 339, 4410, 288, 905,
          1212, 3301, 284, 2650, 317, 4021, 1800, 263, 3015, 611, 2790, 415, 1999, 4200, 330, 720,
          1501, 2330, 355, 4700, 812, 2404, 600, 1100]
TOL = 1e-4
MODES = ["colocated", "disaggregated"]


@pytest.fixture(scope="module")
def urls(tiny_model_dir: str) -> Iterator[dict[str, str]]:
    """colocated, disaggregated (the conductor) and the cluster's prefill instance."""
    with tiny_clusters(tiny_model_dir, SECRET) as found:
        yield found


@pytest.fixture(scope="module")
def hf(tiny_model_dir: str) -> torch.nn.Module:
    """The same tiny model in HF, float32."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i = log-probabilities of the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(url: str, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body: Any) -> list[dict[str, Any]]:
    """Every chunk's choices of a streamed request, in order."""
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += json.loads(line[6:])["choices"]
    return out


def metric(url: str, name: str) -> float:
    """One counter's value from an instance's /metrics."""
    text = httpx.get(url + "/metrics", headers=secret_headers(SECRET), timeout=10).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def output_logprobs_match(hf, prompt: list[int], output: list[int],
                          logprobs: list[float]) -> None:
    reference = hf_logprobs(hf, prompt + output)
    want = [reference[len(prompt) + k - 1, t].item() for k, t in enumerate(output)]
    assert len(logprobs) == len(output)
    assert max(abs(a - b) for a, b in zip(logprobs, want)) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_completion_logprobs_are_hf_log_softmax(urls, hf, mode) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 5,
            "return_token_ids": True}
    cold = post(urls[mode], "/v1/completions", **body)
    out = post(urls[mode], "/v1/completions", **body)  # disaggregated: over a cached prefix
    if mode == "disaggregated":
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert choice_of(cold)["logprobs"]["token_logprobs"] == pytest.approx(
        choice_of(out)["logprobs"]["token_logprobs"], abs=TOL)
    choice = choice_of(out)
    lp = choice["logprobs"]
    output_logprobs_match(hf, PROMPT, choice["token_ids"], lp["token_logprobs"])
    reference = hf_logprobs(hf, PROMPT + choice["token_ids"])
    for k, top in enumerate(lp["top_logprobs"]):
        best = reference[len(PROMPT) + k - 1].topk(5).values
        assert abs(max(top.values()) - best[0].item()) < TOL  # greedy: the chosen is the top
        assert all((best - v).abs().min() < TOL for v in top.values())
    assert len(lp["tokens"]) == len(lp["text_offset"]) == 8
    assert "".join(lp["tokens"]) == choice["text"]  # a byte-level tokenizer decodes by pieces
    assert lp["text_offset"][0] == 0


def choice_of(out: dict[str, Any]) -> dict[str, Any]:
    assert len(out["choices"]) == 1
    return out["choices"][0]


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_raw_whatever_the_sampling(urls, hf, mode) -> None:
    # penalties and temperature change which token is drawn, never its reported score
    out = post(urls[mode], "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=1.3,
               seed=3, frequency_penalty=2.0, logit_bias={"1234": 5}, logprobs=0,
               return_token_ids=True)
    choice = choice_of(out)
    output_logprobs_match(hf, PROMPT, choice["token_ids"], choice["logprobs"]["token_logprobs"])


@pytest.mark.parametrize("mode", MODES)
def test_echo_with_zero_tokens_scores_the_prompt(urls, hf, mode) -> None:
    if mode == "disaggregated":  # the prompt's blocks cached first: echo must still score them
        first = post(urls[mode], "/v1/completions", prompt=PROMPT, max_tokens=1, temperature=0)
        again = post(urls[mode], "/v1/completions", prompt=PROMPT, max_tokens=1, temperature=0)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, (first, again)
    out = post(urls[mode], "/v1/completions", prompt=PROMPT, max_tokens=0, echo=True,
               logprobs=2, temperature=0, return_token_ids=True)
    choice = choice_of(out)
    lp = choice["logprobs"]
    assert choice["token_ids"] == [] and out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed to score
    assert len(lp["token_logprobs"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    reference = hf_logprobs(hf, PROMPT)
    want = [reference[j - 1, PROMPT[j]].item() for j in range(1, len(PROMPT))]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < TOL
    for j, top in enumerate(lp["top_logprobs"][1:], start=1):
        best = reference[j - 1].topk(2).values
        assert abs(max(top.values()) - best[0].item()) < TOL
    assert choice["text"] == "".join(lp["tokens"])  # the prompt, echoed


@pytest.mark.parametrize("mode", MODES)
def test_echo_streamed_equals_echo_whole(urls, hf, mode) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    whole = choice_of(post(urls[mode], "/v1/completions", **body))
    chunks = stream(urls[mode], "/v1/completions", **body)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    offsets = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_are_hf_log_softmax(urls, hf, mode, streamed) -> None:
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
    whole = post(urls[mode], "/v1/chat/completions", **body)
    prompt, choice = whole["prompt_token_ids"], choice_of(whole)
    content = choice["logprobs"]["content"]
    if streamed:
        content = [e for c in stream(urls[mode], "/v1/chat/completions", **body)
                   if c.get("logprobs") for e in c["logprobs"]["content"]]
    output_logprobs_match(hf, prompt, choice["token_ids"], [e["logprob"] for e in content])
    reference = hf_logprobs(hf, prompt + choice["token_ids"])
    for k, entry in enumerate(content):
        best = reference[len(prompt) + k - 1].topk(3)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            best.values.tolist(), abs=TOL)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
        assert bytes(entry["bytes"]).decode() == entry["token"]


def _choices(out: dict[str, Any]) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


@pytest.mark.parametrize("mode", MODES)
def test_n_choices_share_one_prefill_and_repeat_with_the_seed(urls, mode) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 11, "n": 4,
            "return_token_ids": True, "ignore_eos": True}
    # Prompt tokens the engine went through (computed, or reused from a prefill's cache).
    counters, where = ((["mooncake_engine_computed_prompt_tokens_total"], urls["colocated"])
                       if mode == "colocated" else
                       (["mooncake_prefill_computed_tokens_total",
                         "mooncake_prefill_cached_tokens_total"], urls["prefill"]))
    before = sum(metric(where, c) for c in counters)
    first = post(urls[mode], "/v1/completions", **body)
    assert sum(metric(where, c) for c in counters) - before == len(PROMPT)  # prefilled once
    if mode == "colocated":
        assert metric(urls["colocated"], "mooncake_engine_shared_prompt_tokens_total") >= \
            3 * len(PROMPT)
    choices = _choices(first)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert all(len(c) == 8 for c in choices)
    assert len({tuple(c) for c in choices}) == 4  # the choices differ
    assert first["usage"]["prompt_tokens"] == len(PROMPT)
    assert first["usage"]["completion_tokens"] == 32
    assert _choices(post(urls[mode], "/v1/completions", **body)) == choices  # same seed, same
    other = post(urls[mode], "/v1/completions", **{**body, "seed": 12})
    assert _choices(other) != choices
    # streamed: each chunk names its choice; per index, the same tokens
    per_index: dict[int, list[int]] = {i: [] for i in range(4)}
    for chunk in stream(urls[mode], "/v1/completions", **body):
        per_index[chunk["index"]] += chunk.get("token_ids") or []
    assert [per_index[i] for i in range(4)] == choices


def until(predicate: Any, timeout_s: float = 20.0) -> None:
    """Poll `predicate` until true (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", MODES)
def test_n_choices_give_every_block_back(urls, mode) -> None:
    engine = urls["colocated" if mode == "colocated" else "decode"]
    free = metric(engine, "mooncake_engine_free_kv_blocks")
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0.8, "seed": 2, "n": 4,
            "ignore_eos": True, "stream": True}
    # left after a few chunks (the choices cancelled mid-decode), then served to the end
    with httpx.stream("POST", urls[mode] + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 12:
                break
    until(lambda: metric(engine, "mooncake_engine_free_kv_blocks") == free)
    stream(urls[mode], "/v1/completions", **body)
    until(lambda: metric(engine, "mooncake_engine_free_kv_blocks") == free)
    assert metric(engine, "mooncake_engine_running") == 0


@pytest.mark.parametrize("mode", MODES)
def test_chat_n_with_logprobs(urls, hf, mode) -> None:
    out = post(urls[mode], "/v1/chat/completions",
               messages=[{"role": "user", "content": "Hello"}], max_tokens=5, n=3,
               temperature=0.9, seed=5, logprobs=True, return_token_ids=True, ignore_eos=True)
    assert len(out["choices"]) == 3
    for choice in out["choices"]:
        output_logprobs_match(hf, out["prompt_token_ids"], choice["token_ids"],
                              [e["logprob"] for e in choice["logprobs"]["content"]])


# ---- the openai client, which nobody here wrote ------------------------------------------------


@pytest.fixture(params=MODES)
def client(request, urls) -> openai.OpenAI:
    """An `openai` client on one deployment."""
    return openai.OpenAI(base_url=urls[request.param] + "/v1", api_key="unused", max_retries=0)


def test_openai_client_completions_logprobs_echo_n(client, hf) -> None:
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=1)
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    reference = hf_logprobs(hf, PROMPT)
    assert lp.token_logprobs[1] == pytest.approx(reference[0, PROMPT[1]].item(), abs=TOL)
    many = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=3,
                                     temperature=0.8, seed=1, logprobs=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert all(c.logprobs and len(c.logprobs.token_logprobs or []) == len(c.logprobs.tokens or [])
               for c in many.choices)
    assert many.usage is not None and many.usage.prompt_tokens == len(PROMPT)


def test_openai_client_chat_logprobs_and_stream(client) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, n=2, stream=True))
    text = {0: "", 1: ""}
    streamed: list[float] = []
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.index == 0 and choice.logprobs and choice.logprobs.content:
                streamed += [e.logprob for e in choice.logprobs.content]
    assert text[0] == text[1] == whole.choices[0].message.content  # greedy: both the same
    # n=2 decodes both choices in one batch: a fp32 GEMM over 2 rows need not round as one
    # over 1 row does (it does not on the AVX2-only AMD part), so the logprobs agree to float32
    # rounding, not bit for bit; the tokens above are the same either way.
    assert streamed == pytest.approx([e.logprob for e in content], rel=1e-5)
