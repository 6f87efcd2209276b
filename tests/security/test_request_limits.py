"""Request size limits: body bytes (413 on the raw stream), messages, prompt tokens, max_tokens,
stop sequences (400), all before any engine work starts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from security_helpers import MAX_MODEL_LEN, MODEL, EchoBackend

from mooncake_server.api.limits import RequestLimits
from mooncake_server.api.openai_app import install_api
from mooncake_server.cli import parse_config
from mooncake_testkit.in_process import serve_app

LIMITS = RequestLimits(max_body_bytes=4096, max_messages=3, max_prompt_tokens=40, max_tokens=8,
                       max_stop_sequences=2, max_stop_chars=5)


def chat(n_messages: int = 1, **extra: Any) -> dict[str, Any]:
    """A chat body with `n_messages` short user turns."""
    msgs = [{"role": "user", "content": f"hi {i}"} for i in range(n_messages)]
    return {"model": MODEL, "messages": msgs, **extra}


@pytest.fixture
def backend() -> EchoBackend:
    return EchoBackend()


@pytest.fixture
def app(tokenizer: Any, backend: EchoBackend) -> FastAPI:
    app = FastAPI()
    install_api(app, backend, tokenizer, MODEL, MAX_MODEL_LEN, CollectorRegistry(), limits=LIMITS)
    return app


@pytest.fixture
async def url(app: FastAPI) -> AsyncIterator[str]:
    async with serve_app(app) as base:
        yield base


def assert_error(r: httpx.Response, status: int, param: str | None, text: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err


async def test_declared_oversize_body_is_refused_before_it_is_sent(url: str) -> None:
    """Content-Length over the limit: 413 at once, while the client has sent no body at all."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    assert head.startswith(b"HTTP/1.1 413")
    writer.close()


async def test_streamed_oversize_body_is_cut_off(url: str, backend: EchoBackend) -> None:
    """No Content-Length (chunked): 413 as soon as the bytes pass the limit, not at the end."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    sent = 0
    try:
        while not answer.done() and sent < (8 << 20):  # would be 8 MiB if all were read
            writer.write(b"400\r\n" + b"a" * 1024 + b"\r\n")
            await writer.drain()
            sent += 1024
            await asyncio.wait({answer}, timeout=0.002)  # let the server answer if it will
    except ConnectionError:
        pass  # the server hung up on us, as it may
    head = await asyncio.wait_for(answer, timeout=5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert sent < 64 * 1024  # refused a few KiB past the 4 KiB limit, not at the end
    assert backend.requests == []


async def test_body_within_the_limit_is_served(url: str) -> None:
    body = json.dumps(chat(max_tokens=2)).encode()
    padded = body[:-1] + b" " * (LIMITS.max_body_bytes - len(body)) + b"}"
    assert len(padded) == LIMITS.max_body_bytes
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(url + "/v1/chat/completions", content=padded)
        assert r.status_code == 200, r.text
        big = await http.post(url + "/v1/chat/completions", content=padded + b" ")
        assert_error(big, 413, None, "--max-request-size")


@pytest.mark.parametrize("body,param,text", [
    (chat(4), "messages", "at most 3 messages"),
    (chat(1, stop=["a", "b", "c"]), "stop", "at most 2 stop sequences"),
    (chat(1, stop="toolong"), "stop", "at most 5 characters"),
    (chat(1, max_tokens=9), "max_tokens", "at most 8 completion tokens"),
    (chat(1, max_completion_tokens=100), "max_completion_tokens", "at most 8"),
    (chat(1, messages=[{"role": "user", "content": "word " * 60}]), "messages",
     "at most 40 prompt tokens"),
], ids=["messages", "stop-count", "stop-length", "max-tokens", "max-completion-tokens",
        "prompt-tokens"])
async def test_limits_answer_400_before_the_backend(app: FastAPI, backend: EchoBackend,
                                                    body: dict[str, Any], param: str,
                                                    text: str) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert_error(await http.post("/v1/chat/completions", json=body), 400, param, text)
    assert backend.requests == []


async def test_prompt_token_limit_applies_to_completions(app: FastAPI) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        r = await http.post("/v1/completions", json={"prompt": list(range(41)), "max_tokens": 1})
        assert_error(r, 400, "prompt", "41 tokens")
        ok = await http.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": 1})
        assert ok.status_code == 200, ok.text


async def test_missing_max_tokens_is_capped_by_the_limit(app: FastAPI,
                                                         backend: EchoBackend) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200
    assert backend.requests[0].sampling.max_tokens == LIMITS.max_tokens


def test_limits_are_flags_with_sane_defaults() -> None:
    default = RequestLimits.from_config(parse_config([], environ={}))
    assert default == RequestLimits(max_body_bytes=8 << 20, max_messages=2048,
                                    max_prompt_tokens=None, max_tokens=None,
                                    max_stop_sequences=4, max_stop_chars=256)
    cfg = parse_config(["--max-request-size", "1MiB", "--max-messages", "7",
                        "--max-prompt-tokens", "100", "--max-tokens-limit", "50",
                        "--max-stop", "1", "--max-stop-chars", "9"], environ={})
    assert RequestLimits.from_config(cfg) == RequestLimits(1 << 20, 7, 100, 50, 1, 9)
    for argv, flag in ((["--max-request-size", "12"], "--max-request-size"),
                       (["--max-messages", "0"], "--max-messages"),
                       (["--max-tokens-limit", "0"], "--max-tokens-limit"),
                       (["--max-prompt-tokens", "-1"], "--max-prompt-tokens")):
        with pytest.raises(ValueError, match=flag):
            parse_config(argv, environ={})
