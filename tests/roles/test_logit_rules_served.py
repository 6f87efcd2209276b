"""Penalties, logit_bias and min_tokens served for real: a colocated engine and a disaggregated
cluster (the first token sampled by the prefill instance, the rest by the decode instance) over a
tiny random Llama. Each field is checked two ways: it changes the output the way its definition
says, and the output equals a reference that steps HF's own model greedily with the rule written
out plainly here, recomputed from the whole history at every step.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from tiny_served import tiny_clusters
from transformers import AutoModelForCausalLM, AutoTokenizer

SECRET = "logit-rules-secret"
PROMPT = [504, 3458, 282, 4053, 314, 2113, 30, 378, 1390, 282]  # token ids: no chat template
NEW = 12  # tokens asked for


@pytest.fixture(scope="module")
def urls(tiny_model_dir: str) -> Iterator[dict[str, str]]:
    """{"colocated": url, "disaggregated": url (the conductor of prefill + decode + store)}."""
    with tiny_clusters(tiny_model_dir, SECRET) as found:
        yield found


@pytest.fixture(scope="module")
def hf(tiny_model_dir: str) -> torch.nn.Module:
    """The same tiny model in HF, float32."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eos(tiny_model_dir: str) -> int:
    """The tokenizer's EOS id."""
    return int(AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id)


def reference(hf: torch.nn.Module, eos: int, n: int, presence: float = 0.0,
              frequency: float = 0.0, repetition: float = 1.0,
              bias: dict[int, float] | None = None, min_tokens: int = 0) -> list[int]:
    """Greedy tokens of HF's model with the rules applied to each step's logits."""
    ids = list(PROMPT)
    out: list[int] = []
    while len(out) < n:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float().clone()
        for token in set(ids):  # repetition: prompt and output
            if repetition != 1.0:
                v = logits[token]
                logits[token] = v / repetition if v > 0 else v * repetition
        for token, count in Counter(out).items():  # presence, frequency: output only
            logits[token] -= frequency * count + presence
        for token, b in (bias or {}).items():
            logits[token] += b
        if len(out) < min_tokens:
            logits[eos] = float("-inf")
        token = int(torch.argmax(logits))
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def complete(url: str, **fields: Any) -> tuple[list[int], str]:
    """Greedy /v1/completions over PROMPT: (output token ids, finish_reason)."""
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "return_token_ids": True,
            **fields}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["finish_reason"]


def repeats(tokens: list[int], prompt: list[int] | None = None) -> int:
    """Tokens that were already seen (earlier in `tokens`, or in `prompt`)."""
    seen = set(prompt or [])
    n = 0
    for t in tokens:
        n += t in seen
        seen.add(t)
    return n


MODES = ["colocated", "disaggregated"]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_without_rules_equals_the_reference(urls, hf, eos, mode: str) -> None:
    tokens, _ = complete(urls[mode])
    assert tokens == reference(hf, eos, NEW)


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_plus_100_forces_a_token_minus_100_bans_one(urls, hf, eos, mode) -> None:
    plain, _ = complete(urls[mode])
    forced = 1234
    tokens, _ = complete(urls[mode], logit_bias={str(forced): 100})
    assert tokens == [forced] * NEW == reference(hf, eos, NEW, bias={forced: 100})
    ban = {str(t): -100 for t in set(plain)}
    tokens, _ = complete(urls[mode], logit_bias=ban)
    assert not set(tokens) & set(plain)
    assert tokens == reference(hf, eos, NEW, bias={int(k): v for k, v in ban.items()})


@pytest.mark.parametrize("mode", MODES)
def test_frequency_penalty_stops_repeats(urls, hf, eos, mode) -> None:
    plain, _ = complete(urls[mode])
    assert repeats(plain) > 0  # the tiny model repeats itself when left alone
    tokens, _ = complete(urls[mode], frequency_penalty=2.0)
    assert repeats(tokens) < repeats(plain)
    assert tokens == reference(hf, eos, NEW, frequency=2.0)
    # the signs as OpenAI defines them: presence 2 with frequency -2 leaves a token said once
    # untouched (2 - 2*1 = 0) and favours one said more often, so greedy stays as it was
    tokens, _ = complete(urls[mode], frequency_penalty=-2.0, presence_penalty=2.0)
    assert tokens == plain == reference(hf, eos, NEW, frequency=-2.0, presence=2.0)


@pytest.mark.parametrize("mode", MODES)
def test_presence_penalty_stops_repeats(urls, hf, eos, mode) -> None:
    plain, _ = complete(urls[mode])
    tokens, _ = complete(urls[mode], presence_penalty=2.0)
    assert repeats(tokens) < repeats(plain)
    assert tokens == reference(hf, eos, NEW, presence=2.0)


@pytest.mark.parametrize("mode", MODES)
def test_repetition_penalty_avoids_prompt_and_output_tokens(urls, hf, eos, mode) -> None:
    plain, _ = complete(urls[mode])
    tokens, _ = complete(urls[mode], repetition_penalty=2.0)
    assert repeats(tokens, PROMPT) < repeats(plain, PROMPT)
    assert tokens == reference(hf, eos, NEW, repetition=2.0)


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_keeps_eos_out(urls, hf, eos, mode) -> None:
    # +100 on EOS makes the greedy answer end at once; min_tokens holds it off
    tokens, reason = complete(urls[mode], logit_bias={str(eos): 100})
    assert (tokens, reason) == ([eos], "stop")
    tokens, reason = complete(urls[mode], logit_bias={str(eos): 100}, min_tokens=5)
    assert reason == "stop" and len(tokens) == 6 and eos not in tokens[:5] and tokens[5] == eos
    assert tokens == reference(hf, eos, NEW, bias={eos: 100}, min_tokens=5)


@pytest.mark.parametrize("mode", MODES)
def test_streamed_chat_applies_the_same_rules(urls, hf, eos, mode) -> None:
    fields = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3,
              "logit_bias": {"1234": 3}}
    tokens, _ = complete(urls[mode], **fields)
    assert tokens == reference(hf, eos, NEW, presence=0.5, frequency=1.5, repetition=1.3,
                               bias={1234: 3})
    streamed: list[int] = []
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "return_token_ids": True,
            "stream": True, **fields}
    with httpx.stream("POST", urls[mode] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice.get("token_ids") or []
    assert streamed == tokens
