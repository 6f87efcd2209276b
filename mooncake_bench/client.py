"""Load generation against an OpenAI-compatible server: prompts that round-trip through the
tokenizer, the streamed /v1/completions request, and what each request measured.

Prompts are token ids of single-token words (" word"): their text tokenizes back to exactly the
same ids, so `transformers serve`, whose /v1/completions takes only string prompts, computes the
same tokens that mooncake-server is given as ids. transformers serve rejects `ignore_eos`
(422); it gets `generation_config` = '{"max_new_tokens": N, "eos_token_id": -1}' (a JSON
string) for exact lengths instead.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from mooncake_bench.trace import Outcome, PromptBuilder, TraceRequest


def word_token_ids(tokenizer: Any, lo: int = 1000) -> list[int]:
    """Ids (>= lo) of tokens that are one space-led ASCII word and encode back to themselves."""
    ids = []
    for piece, i in tokenizer.get_vocab().items():
        # "Ġ" is the byte-level space: the pre-tokenizer splits text before each such word, so
        # a sequence of them re-tokenizes token by token.
        if i >= lo and re.fullmatch(r"\u0120[A-Za-z]+", piece) \
                and tokenizer.encode(tokenizer.decode([i])).ids == [i]:
            ids.append(i)
    return sorted(ids)


class Prompts:
    """Random prompts of word tokens, as ids and as the text that tokenizes to those ids."""

    def __init__(self, model_path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        self.ids = word_token_ids(self.tokenizer)
        if len(self.ids) < 1000:
            raise RuntimeError(f"only {len(self.ids)} single-token words in {model_path}'s "
                               "vocabulary: cannot build round-tripping prompts")

    def random(self, n: int, seed: int | str) -> list[int]:
        """`n` token ids, the same for the same seed."""
        rnd = random.Random(f"bench_serving:{seed}")  # NOTE: the seed text keeps old prompts
        return [self.ids[rnd.randrange(len(self.ids))] for _ in range(n)]

    def builder(self, block_tokens: int, seed: int) -> PromptBuilder:
        """replay_trace's hash-id prompts, drawing indices into the word vocabulary."""
        return PromptBuilder(block_tokens, (0, len(self.ids)), seed)

    def trace_prompt(self, builder: PromptBuilder, req: TraceRequest,
                     index: int) -> list[int]:
        """The word-token prompt of one trace request (shared hash-id prefixes stay shared)."""
        return [self.ids[i] for i in builder.prompt(req, index)]

    def text(self, ids: Sequence[int]) -> str:
        """The text of `ids`."""
        return self.tokenizer.decode(list(ids))

    def round_trips(self, ids: Sequence[int]) -> bool:
        """Whether the text of `ids` tokenizes back to exactly `ids`."""
        return self.tokenizer.encode(self.text(ids), add_special_tokens=True).ids == list(ids)


@dataclass
class Api:
    """Where and how to send completions to one system."""

    kind: str  # mooncake | tfserve
    url: str
    model: str
    prompts: Prompts | None = None  # tfserve: turns ids into text


def completion_body(api: Api, prompt: Sequence[int], max_tokens: int,
                    sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The streamed, exactly-`max_tokens` /v1/completions body for `api`'s server.

    Greedy unless `sampling` gives other fields (temperature, top_p, seed).
    """
    body: dict[str, Any] = {"model": api.model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, **(sampling or {})}
    if api.kind == "tfserve":
        assert api.prompts is not None
        body["prompt"] = api.prompts.text(prompt)
        # It parses this field with json.loads (a dict is a 500), and 422s `ignore_eos`; an
        # eos id no token has is its way to never stop early.
        body["generation_config"] = json.dumps({"max_new_tokens": max_tokens,
                                                "eos_token_id": -1})
    else:
        body["prompt"] = list(prompt)
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Result(Outcome):
    """replay_trace's Outcome plus what the throughput figures need."""

    requested_tokens: int = 0
    completion_tokens: int = 0  # usage.completion_tokens, else the token chunks seen
    finished: bool = False  # a finish_reason arrived


def parse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON of one SSE `data:` line (None for other lines and [DONE])."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data.startswith("{"):
        return None
    return json.loads(data)


async def send(client: httpx.AsyncClient, api: Api, prompt: Sequence[int],
               max_tokens: int, sampling: dict[str, Any] | None = None) -> Result:
    """One streamed completion; never raises (HTTP 429 = rejected, anything else wrong = error)."""
    out = Result("ok", prompt_tokens=len(prompt), requested_tokens=max_tokens)
    first_chunk: float | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{api.url}/v1/completions",
                                 json=completion_body(api, prompt, max_tokens, sampling)) as r:
            if r.status_code != 200:
                await r.aread()
                out.status = "rejected" if r.status_code == 429 else "error"
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            async for line in r.aiter_lines():
                chunk = parse_chunk(line)
                if chunk is None:
                    continue
                now = time.perf_counter() - start
                if chunk.get("error"):
                    out.status, out.error = "error", str(chunk["error"])[:200]
                    return out
                choices = chunk.get("choices") or []
                if choices and first_chunk is None:
                    first_chunk = now
                # A token is an event the user sees: text. Finish / usage-only chunks are not
                # tokens (transformers serve sends an empty one after the last token).
                if any(c.get("text") for c in choices):
                    out.token_times.append(now)
                if any(c.get("finish_reason") for c in choices):
                    out.finished = True
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens") or len(prompt)
                    out.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, ValueError) as exc:
        out.status, out.error = "error", repr(exc)[:200]
        return out
    if not out.finished:
        out.status, out.error = "error", "stream ended without a finish_reason"
        return out
    if not out.token_times and first_chunk is not None:
        out.token_times.append(first_chunk)  # the only token's text was empty
    out.ttft_s = out.token_times[0] if out.token_times else None
    out.completion_tokens = out.completion_tokens or len(out.token_times)
    return out


def new_client(timeout_s: float) -> httpx.AsyncClient:
    """An HTTP client for many concurrent streams, each bounded by `timeout_s`."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits)


def errors_of(results: Sequence[Result]) -> dict[str, Any]:
    """Counts of rejected / failed / short requests and the first error text."""
    errs = [r.error for r in results if r.status != "ok"]
    return {"rejected": sum(r.status == "rejected" for r in results),
            "errors": sum(r.status == "error" for r in results),
            "short": sum(r.status == "ok" and r.completion_tokens < r.requested_tokens
                         for r in results),
            "first_error": errs[0] if errs else ""}


async def warm_up(api: Api, prompts: Prompts, prompt_tokens: int, timeout_s: float) -> None:
    """Requests no measurement shares a prefix with: first-request set-up (CB init, allocators)."""
    async with new_client(timeout_s) as client:
        for n in sorted({16, prompt_tokens}):
            r = await send(client, api, prompts.random(n, f"warm:{n}"), 4)
            if r.status != "ok":
                print(f"  warm-up ({n} tokens) failed: {r.error}", file=sys.stderr)
