"""presence/frequency/repetition penalties, logit_bias, min_tokens at the API: what reaches the
backend, what is refused (400, OpenAI's error body), and stop strings under min_tokens."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_helpers import MODEL, FakeBackend

from mooncake_server.api.detokenizer import IncrementalDetokenizer
from mooncake_server.wire.jobs import SamplingParams

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}


async def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url) as client:
        return await client.post(path, json=body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_the_fields_reach_the_backend(base_url: str, backend: FakeBackend,
                                            path: str) -> None:
    backend.token_ids = [11, 12]
    body = {**CHAT, "prompt": "Say hello", "presence_penalty": 0.5, "frequency_penalty": -1.25,
            "repetition_penalty": 1.2, "logit_bias": {"42": 100, "7": -100}, "min_tokens": 2}
    r = await post(base_url, path, body)
    assert r.status_code == 200, r.text
    sampling = backend.requests[0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.25)
    assert sampling.repetition_penalty == 1.2
    assert sampling.logit_bias == {42: 100.0, 7: -100.0}  # JSON's string keys became ids
    assert sampling.min_tokens == 2 and sampling.adjusts_logits


async def test_a_request_without_them_changes_nothing(base_url: str, backend: FakeBackend) -> None:
    backend.token_ids = [11]
    r = await post(base_url, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    sampling = backend.requests[0].sampling
    assert not sampling.adjusts_logits
    defaults = SamplingParams(max_tokens=1)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
            sampling.logit_bias, sampling.min_tokens) == (
        defaults.presence_penalty, defaults.frequency_penalty, defaults.repetition_penalty,
        defaults.logit_bias, defaults.min_tokens)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"repetition_penalty": 3}, "repetition_penalty", "less than or equal to 2"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "negative"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "valid integer"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 entries"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias", "not in the vocabulary"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"min_tokens": 9}, "min_tokens", "at most max_tokens (8)"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_out_of_range_values_are_400(base_url: str, backend: FakeBackend, path: str,
                                           extra: dict[str, Any], param: str, words: str) -> None:
    r = await post(base_url, path, {**CHAT, "prompt": "Say hello", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"].startswith(param), err
    assert words in err["message"], err
    assert backend.requests == []  # refused before any engine work


async def test_min_tokens_above_the_filled_context_is_400(base_url: str) -> None:
    # without max_tokens the completion may fill the context; min_tokens must fit in it too
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    r = await post(base_url, "/v1/chat/completions", {**body, "min_tokens": 10_000})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_tokens"


def test_stop_strings_count_only_from_the_min_tokens_th_token(tokenizer: Any) -> None:
    ids = tokenizer(" one. two. three.")["input_ids"]
    first_dot = next(i for i, t in enumerate(ids) if "." in tokenizer.decode([t]))

    def run(min_tokens: int) -> str:
        detok = IncrementalDetokenizer(tokenizer, ["."], min_tokens)
        out = ""
        for token in ids:
            out += detok.add(token)
            if detok.stopped:
                return out
        return out + detok.finish()

    assert run(0) == " one"
    assert run(first_dot + 1) == " one"  # the stop string ends in token min_tokens: it counts
    assert run(first_dot + 2) == " one. two"  # the first "." came too early to count
    assert run(len(ids) + 1) == " one. two. three."
