"""The conductor app end to end over HTTP, with scripted prefill / decode / store peers.

The peers are tiny FastAPI apps (no model); the conductor is the real one: it loads the real
tokenizer, the peers join through Registrar, and clients talk to it with the openai SDK.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import StreamingResponse

from mooncake_server.block_keys import block_keys, kv_namespace
from mooncake_server.config import ServerConfig
from mooncake_server.instance.registrar import Registrar
from mooncake_server.roles.conductor.app import build_app
from mooncake_server.wire.auth import require_secret
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.jobs import DecodeEvent, DecodeJob, PrefillJob, PrefillResult
from mooncake_server.wire.store_ops import StoreKeys
from mooncake_testkit.in_process import serve_app

SECRET = "cluster-s3cret"
MODEL = "smol"


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


@dataclass
class Peers:
    """What the scripted peers saw, and what they answer."""

    first_token: int = 0
    decode_tokens: list[int] = field(default_factory=list)
    decode_hang: bool = False
    prefill_jobs: list[PrefillJob] = field(default_factory=list)
    decode_jobs: list[DecodeJob] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    decode_disconnects: int = 0


def peers_app(peers: Peers) -> FastAPI:
    app = FastAPI()
    guard = [Depends(require_secret(SECRET))]

    @app.post("/internal/prefill", dependencies=guard)
    async def prefill(job: PrefillJob) -> PrefillResult:
        peers.prefill_jobs.append(job)
        return PrefillResult(request_id=job.request_id, first_token=peers.first_token,
                             cached_tokens=16, tail_key="tail", block_checksums=[],
                             prefill_seconds=0.0)

    @app.post("/internal/decode", dependencies=guard)
    async def decode(job: DecodeJob) -> StreamingResponse:
        peers.decode_jobs.append(job)

        async def lines() -> AsyncIterator[bytes]:
            try:
                for i, token in enumerate(peers.decode_tokens):
                    last = i == len(peers.decode_tokens) - 1 and not peers.decode_hang
                    event = DecodeEvent(token_id=token, finish_reason="stop" if last else None)
                    yield event.model_dump_json().encode() + b"\n"
                if peers.decode_hang:
                    await asyncio.Event().wait()
            except asyncio.CancelledError:
                peers.decode_disconnects += 1
                raise

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/store/remove", dependencies=guard)
    async def remove(body: StoreKeys) -> dict[str, int]:
        peers.removed.extend(body.keys)
        return {"removed": len(body.keys)}

    return app


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from mooncake_server.model_assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


async def test_conductor_end_to_end(tokenizer: Any) -> None:
    peers = Peers()
    config = ServerConfig(role="conductor", cluster_secret=SECRET, served_model_name=MODEL,
                          max_model_len=1024, heartbeat_timeout_s=5.0)
    async with serve_app(peers_app(peers)) as peer_url, serve_app(build_app(config)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.get("/health")
            assert r.status_code == 503
            assert r.json()["instances"] == {"prefill": 0, "decode": 0, "store": 0}
            assert (await http.get("/internal/instances")).status_code == 401

            registrars = [
                Registrar(url, InstanceInfo(instance_id=f"{role}-1", role=role, url=peer_url,
                                            transfer_address="127.0.0.1:1", segment="seg"),
                          SECRET, 0.05)
                for role in ("store", "prefill", "decode")
            ]
            for registrar in registrars:
                await registrar.start()
            r = await http.get("/health")
            assert r.status_code == 200
            assert r.json()["instances"] == {"prefill": 1, "decode": 1, "store": 1}

            text = "Hello from the disaggregated path!"
            ids = tokenizer(text)["input_ids"]
            peers.first_token, peers.decode_tokens = ids[0], ids[1:] + [tokenizer.eos_token_id]
            messages = [{"role": "user", "content": "Please greet me warmly. " * 3}]
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as client:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=messages, stream=True,
                    stream_options={"include_usage": True})
                chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16
            assert chunks[-1].usage.completion_tokens == len(ids) + 1

            job = peers.prefill_jobs[0]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True)["input_ids"]
            assert job.prompt_token_ids == prompt
            assert len(job.block_keys) == len(prompt) // config.block_tokens
            assert job.block_keys == block_keys(prompt, config.block_tokens,
                                                kv_namespace(MODEL, config.dtype, config.block_tokens))
            assert tokenizer.eos_token_id in job.sampling.eos_token_ids
            assert peers.decode_jobs[0].first_token == ids[0]

            # A client that leaves mid-stream: the decode instance sees the disconnect.
            peers.decode_hang = True
            async with http.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if '"content"' in line and '"content":""' not in line.replace(" ", ""):
                        break
            await wait_for(lambda: peers.decode_disconnects == 1)

            body = (await http.get("/metrics")).text
            assert 'mooncake_conductor_instances_alive{role="decode"} 1.0' in body
            assert 'mooncake_api_requests_total{endpoint="chat",status="200"} 1.0' in body

            for registrar in registrars:
                await registrar.stop()
            assert (await http.get("/health")).status_code == 503
            r = await http.post("/v1/chat/completions", json={"model": MODEL,
                                                              "messages": messages})
            assert r.status_code == 503
            assert r.json()["error"]["message"] == "no store instance available"
