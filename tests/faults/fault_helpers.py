"""Client side of the fault tests: greedy streamed completions over token-id prompts, the
conductor's view of requests, metric scraping, polling with deadlines."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from mooncake_testkit.role_procs import RoleCluster

MODEL = "SmolLM2-135M-Instruct"


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic token-id prompt of `n` ordinary tokens."""
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 40000) for _ in range(n)]


@dataclass
class Stream:
    """One streamed greedy completion as the client saw it."""

    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int | None = None
    status: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream_completion(url: str, prompt: list[int], max_tokens: int,
                            out: Stream | None = None, timeout_s: float = 120.0) -> Stream:
    """Stream a greedy /v1/completions (ignore_eos) and collect its token ids in order."""
    out = out or Stream()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    async with (httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5)) as http,
                http.stream("POST", url + "/v1/completions", json=body) as r):
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            raise AssertionError(f"HTTP {r.status_code}: {r.text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            out.request_id = chunk["id"]
            out.started.set()
            for choice in chunk.get("choices", []):
                out.tokens += choice.get("token_ids") or []
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens")
    return out


async def complete(url: str, prompt: list[int], max_tokens: int) -> Stream:
    """A streamed completion run to its end, with nothing happening to the cluster."""
    return await stream_completion(url, prompt, max_tokens)


async def until(predicate: Callable[[], object], timeout_s: float, what: str,
                poll_s: float = 0.02) -> None:
    """Poll `predicate` until truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(poll_s)


def wait_sync(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """Blocking `until`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


def running(cluster: RoleCluster) -> dict[str, dict[str, object]]:
    """The conductor's requests in flight, by request id."""
    r = httpx.get(cluster.url + "/internal/requests", headers=cluster.headers, timeout=5)
    r.raise_for_status()
    return {item["request_id"]: item for item in r.json()}


def serving(cluster: RoleCluster, request_id: str) -> str | None:
    """The instance serving a request now (None once it finished)."""
    item = running(cluster).get(request_id)
    return str(item["instance_id"]) if item else None


def metric(text: str, name: str, labels: str | None = None) -> float:
    """Sum of the samples of `name` (only those whose labels contain `labels`), 0 if none."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        if labels is None or labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def role_metric(cluster: RoleCluster, name: str, metric_name: str,
                labels: str | None = None) -> float:
    """One role's metric (see `metric`)."""
    return metric(cluster.metrics(name), metric_name, labels)
