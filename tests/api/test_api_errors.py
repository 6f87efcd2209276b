"""Every error a client can provoke comes back as an OpenAI error body with the right status."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_helpers import EOS, MAX_MODEL_LEN, MODEL, FakeBackend  # noqa: I001

from mooncake_server.api.backend import BackendError

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}]}


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


async def post(base_url: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url) as client:
        return await client.post(path, **kwargs)


async def test_malformed_json(base_url: str) -> None:
    r = await post(base_url, "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    assert "malformed JSON" in err["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"model": MODEL}, "messages", "required"),
    ({**CHAT, "messages": []}, "messages", "at least 1"),
    ({**CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({**CHAT, "n": 9}, "n", "at most 8 choices"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    ({**CHAT, "temperature": -1}, "temperature", "greater than or equal"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'user'"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type", "'text'"),
])
async def test_invalid_fields(base_url: str, body: dict[str, Any], param: str,
                              words: str) -> None:
    r = await post(base_url, "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert words in err["message"]


async def test_bad_completion_prompt(base_url: str) -> None:
    r = await post(base_url, "/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]})
    assert r.status_code == 400
    assert error_of(r)["param"] == "prompt"
    r = await post(base_url, "/v1/completions", json={"model": MODEL, "prompt": ""})
    assert r.status_code == 400


async def test_unknown_model(base_url: str) -> None:
    r = await post(base_url, "/v1/chat/completions", json={**CHAT, "model": "gpt-17"})
    assert r.status_code == 404
    err = error_of(r)
    assert err["code"] == "model_not_found"
    assert "gpt-17" in err["message"] and MODEL in err["message"]


async def test_prompt_plus_max_tokens_too_long(base_url: str, tokenizer: Any) -> None:
    n_prompt = len(tokenizer.apply_chat_template(
        CHAT["messages"], add_generation_prompt=True, tokenize=True)["input_ids"])
    r = await post(base_url, "/v1/chat/completions", json={**CHAT, "max_tokens": 250})
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "context_length_exceeded"
    for number in (MAX_MODEL_LEN, n_prompt + 250, n_prompt, 250):
        assert str(number) in err["message"]


async def test_prompt_alone_too_long(base_url: str) -> None:
    long_text = "word " * (MAX_MODEL_LEN * 2)
    r = await post(base_url, "/v1/chat/completions",
                   json={**CHAT, "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400
    assert str(MAX_MODEL_LEN) in error_of(r)["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_error_keeps_its_status(base_url: str, backend: FakeBackend,
                                              stream: bool) -> None:
    backend.fail_before_first = BackendError("no prefill instance available", 503)
    r = await post(base_url, "/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 503
    err = error_of(r)
    assert err["message"] == "no prefill instance available"
    assert err["type"] == "server_error"
    assert len(backend.closed) == 1


async def test_rejection_carries_retry_after(base_url: str, backend: FakeBackend) -> None:
    exc = BackendError("TTFT SLO cannot be met", 429, code="slo_rejected")
    exc.retry_after_s = 2.4  # type: ignore[attr-defined]
    backend.fail_before_first = exc
    r = await post(base_url, "/v1/chat/completions", json=CHAT)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert error_of(r)["code"] == "slo_rejected"


async def test_unexpected_error_is_a_generic_500(base_url: str, backend: FakeBackend) -> None:
    backend.fail_before_first = RuntimeError("secret internal detail")  # type: ignore[assignment]
    r = await post(base_url, "/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    err = error_of(r)
    assert "secret internal detail" not in err["message"]
    assert err["type"] == "server_error"


async def test_unknown_route_and_method(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        assert error_of(await client.get("/v1/nothing"))["type"] == "not_found_error"
        r = await client.get("/v1/chat/completions")
    assert r.status_code == 405
    error_of(r)


async def test_server_keeps_serving_after_errors(base_url: str, backend: FakeBackend,
                                                 tokenizer: Any) -> None:
    await post(base_url, "/v1/chat/completions", content=b"{")
    await post(base_url, "/v1/chat/completions", json={**CHAT, "n": 30})
    backend.fail_before_first = BackendError("boom", 503)
    await post(base_url, "/v1/chat/completions", json=CHAT)
    backend.fail_before_first = None
    backend.token_ids = tokenizer("fine")["input_ids"] + [EOS]
    r = await post(base_url, "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "fine"


async def test_backend_without_tokens_is_a_502(base_url: str, backend: FakeBackend) -> None:
    backend.token_ids = []
    r = await post(base_url, "/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert "without a token" in error_of(r)["message"]
