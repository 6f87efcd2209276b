"""The OpenAI API over a fake backend, through a live server, as clients see it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from api_helpers import EOS, MAX_MODEL_LEN, MODEL, FakeBackend  # noqa: I001
from prometheus_client import CollectorRegistry

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}]}


def prompt_len(tokenizer: Any, content: str = "Say hello") -> int:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    return len(out["input_ids"])


def script(backend: FakeBackend, tokenizer: Any, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer(text)["input_ids"] + ([EOS] if eos else [])
    backend.token_ids = ids
    return ids


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body into JSON payloads, keeping the final [DONE] as a string."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_models_lists_the_served_model(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert r.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN


async def test_chat_completion(base_url: str, backend: FakeBackend, tokenizer: Any,
                               metrics_registry: CollectorRegistry) -> None:
    ids = script(backend, tokenizer, "Hello there, friend!")
    backend.cached_tokens = 16
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused") as client:
        resp = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    assert resp.choices[0].message.content == "Hello there, friend!"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    n_prompt = prompt_len(tokenizer)
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.usage.completion_tokens == len(ids)
    assert resp.usage.total_tokens == n_prompt + len(ids)
    assert resp.usage.prompt_tokens_details.cached_tokens == 16
    sampling = backend.requests[0].sampling
    assert sampling.max_tokens == MAX_MODEL_LEN - n_prompt  # default: fill the context
    assert sampling.temperature == 1.0 and EOS in sampling.eos_token_ids
    assert backend.closed == [backend.requests[0].request_id]
    assert sample(metrics_registry, "mooncake_api_requests_total",
                  endpoint="chat", status="200") == 1
    assert sample(metrics_registry, "mooncake_api_generation_tokens_total") == len(ids)
    assert sample(metrics_registry, "mooncake_api_time_to_first_token_seconds_count") == 1
    assert sample(metrics_registry, "mooncake_api_requests_running") == 0


async def test_chat_request_fields_reach_the_backend(base_url: str, backend: FakeBackend,
                                                     tokenizer: Any) -> None:
    script(backend, tokenizer, "ok")
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Say hello"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
        "seed": 3, "ignore_eos": True, "some_future_field": {"x": 1},
    }
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    sampling = backend.requests[0].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (7, 0, 0.5, 3)
    assert sampling.greedy and sampling.ignore_eos
    assert tokenizer.decode(backend.requests[0].prompt_token_ids).count("Be brief.") == 1


async def test_chat_stream_with_usage(base_url: str, backend: FakeBackend, tokenizer: Any) -> None:
    ids = script(backend, tokenizer, "Streaming works: 😀 done.")
    backend.cached_tokens = 16
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused") as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming works: 😀 done."
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(ids)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


async def test_stream_wire_format_ends_with_done(base_url: str, backend: FakeBackend,
                                                 tokenizer: Any) -> None:
    script(backend, tokenizer, "Hi")
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "usage" not in events[-2]  # no include_usage -> no usage chunk


async def test_completions(base_url: str, backend: FakeBackend, tokenizer: Any) -> None:
    ids = script(backend, tokenizer, " jumps over the lazy dog", eos=False)
    backend.finish_reason = "length"
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "The quick fox"})
        r_ids = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " jumps over the lazy dog"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(tokenizer("The quick fox")["input_ids"])
    assert body["usage"]["completion_tokens"] == len(ids)
    assert backend.requests[0].sampling.max_tokens == 16  # the completions API default
    assert r_ids.status_code == 200
    assert backend.requests[1].prompt_token_ids == [1, 2, 3]


async def test_completions_stream(base_url: str, backend: FakeBackend, tokenizer: Any) -> None:
    ids = script(backend, tokenizer, "abc def")
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "stream": True,
            "stream_options": {"include_usage": True},
        })
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "abc def"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_truncates_and_cancels(base_url: str, backend: FakeBackend,
                                                 tokenizer: Any, stream: bool) -> None:
    ids = script(backend, tokenizer, "One two. END of story, and much more text after it")
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post("/v1/chat/completions",
                              json={**CHAT, "stop": ["never", " END"], "stream": stream})
    assert r.status_code == 200
    if stream:
        events = sse_events(r.text)
        pieces = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
        assert "".join(pieces) == "One two."
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    else:
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == ("One two.", "stop")
    assert backend.closed == [backend.requests[0].request_id]
    assert backend.yielded < len(ids)  # the backend was cancelled, not drained


async def test_client_disconnect_closes_backend_stream(base_url: str, backend: FakeBackend,
                                                       tokenizer: Any, wait_for: Any) -> None:
    script(backend, tokenizer, "a b c d e f g h")
    backend.hang_after = 3
    async with httpx.AsyncClient(base_url=base_url) as client:
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**CHAT, "stream": True}) as r:
            async for line in r.aiter_lines():
                if '"content":"a"' in line.replace(" ", ""):
                    break
    await wait_for(lambda: len(backend.closed) == 1)


async def test_client_disconnect_non_streaming(base_url: str, backend: FakeBackend,
                                               tokenizer: Any, wait_for: Any) -> None:
    script(backend, tokenizer, "a b c")
    backend.hang_after = 1

    async def abandoned() -> None:
        async with httpx.AsyncClient(base_url=base_url) as client:
            await client.post("/v1/chat/completions", json=CHAT)

    import asyncio

    task = asyncio.create_task(abandoned())
    await wait_for(lambda: backend.yielded == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_for(lambda: len(backend.closed) == 1)


async def test_mid_stream_failure_sends_error_event_then_done(
        base_url: str, backend: FakeBackend, tokenizer: Any,
        metrics_registry: CollectorRegistry) -> None:
    script(backend, tokenizer, "one two three four")
    backend.fail_after = 2
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "decode instance lost"
    assert events[-2]["error"]["type"] == "server_error"
    assert sample(metrics_registry, "mooncake_api_requests_total",
                  endpoint="chat", status="stream_error") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_return_token_ids(base_url: str, backend: FakeBackend, tokenizer: Any,
                                stream: bool) -> None:
    ids = script(backend, tokenizer, "Token ids, please.")
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post("/v1/chat/completions",
                              json={**CHAT, "return_token_ids": True, "stream": stream})
        plain = await client.post("/v1/chat/completions", json=CHAT)
    prompt = tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    if stream:
        events = sse_events(r.text)[:-1]
        assert events[0]["prompt_token_ids"] == prompt
        assert sum((e["choices"][0]["token_ids"] for e in events), []) == ids  # EOS included
    else:
        assert r.json()["prompt_token_ids"] == prompt
        assert r.json()["choices"][0]["token_ids"] == ids
    assert "prompt_token_ids" not in plain.json()
    assert "token_ids" not in plain.json()["choices"][0]
