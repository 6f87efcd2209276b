"""The workloads a serving benchmark sends (each against one started system): single-request
TTFT by prompt size, N concurrent streams, and a trace replay at its (scaled) arrival times;
with the figures each reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from mooncake_bench import trace as rt
from mooncake_bench.client import Api, Prompts, Result, errors_of, new_client, send


async def ttft_workload(api: Api, prompts: Prompts, sizes: Sequence[int], reps: int,
                        max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """Per prompt size: p50 TTFT of `reps` requests sent one at a time, distinct prompts."""
    out: dict[str, Any] = {}
    async with new_client(timeout_s) as client:
        for n in sizes:
            results = [await send(client, api, prompts.random(n, f"ttft:{n}:{i}"), max_tokens)
                       for i in range(reps)]
            ttfts = [r.ttft_s for r in results if r.status == "ok" and r.ttft_s is not None]
            out[str(n)] = {"ttft_p50": rt.percentile(ttfts, 50), "ttfts": ttfts,
                           "prompt_tokens_seen": [r.prompt_tokens for r in results],
                           **errors_of(results)}
    return out


def concurrent_summary(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    """Output tok/s, TBT p50 over all gaps and over requests (paper TBT), TTFT p50."""
    ok = [r for r in results if r.status == "ok"]
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    per_request = [t for t in (rt.request_tbt(r.token_times) for r in ok) if t is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {"requests": len(results), "ok": len(ok), "wall_s": wall_s,
            "output_tokens": tokens,
            "output_tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
            "tbt_p50_gaps": rt.percentile(gaps, 50), "tbt_p99_gaps": rt.percentile(gaps, 99),
            "tbt_p50_per_request": rt.percentile(per_request, 50),
            "ttft_p50": rt.percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
            **errors_of(results)}


async def concurrent_workload(api: Api, prompts: Prompts, n: int, prompt_tokens: int,
                              output_tokens: int, timeout_s: float,
                              sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """`n` requests sent at once; figures over the wall time until the last one ends."""
    async with new_client(timeout_s) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            send(client, api, prompts.random(prompt_tokens, f"conc:{i}"), output_tokens,
                 sampling)
            for i in range(n)))
        wall = time.perf_counter() - start
    return concurrent_summary(results, wall)


def offered_load(trace: Sequence[rt.TraceRequest], prompts: Prompts, block_tokens: int,
                 time_scale: float, max_output: int) -> dict[str, float]:
    """What the replay asks per second: requests, prompt tokens, output tokens."""
    b = prompts.builder(block_tokens, 0)
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 * time_scale
    span = max(span, 1e-9)
    return {"span_s": span, "requests_s": len(trace) / span,
            "prompt_tok_s": sum(b.length(r) for r in trace) / span,
            "output_tok_s": sum(min(r.output_length, max_output) for r in trace) / span}


async def replay(api: Api, prompts: Prompts, trace: Sequence[rt.TraceRequest], block_tokens: int,
                 seed: int, time_scale: float, max_output: int,
                 timeout_s: float) -> list[Result]:
    """Each trace request at its scaled arrival time (replay_trace's prompts); all outcomes."""
    builder = prompts.builder(block_tokens, seed)
    t0 = trace[0].timestamp_ms if trace else 0.0
    async with new_client(timeout_s) as client:
        begin = time.perf_counter()

        async def one(i: int, req: rt.TraceRequest) -> Result:
            at = (req.timestamp_ms - t0) / 1000.0 * time_scale
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            r = await send(client, api, prompts.trace_prompt(builder, req, i),
                           max(1, min(req.output_length, max_output)))
            r.arrival_s = at
            return r

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(trace))))


def replay_summary(results: Sequence[Result], ttft_slo: float, tbt_slo: float,
                   wall_s: float) -> dict[str, Any]:
    """replay_trace's summary plus the count behind effective capacity."""
    s = rt.summarize(results, ttft_slo, tbt_slo)
    s.wall_s = wall_s
    d = asdict(s)
    d["within_slo_count"] = round(s.within_slo * s.requests) if s.requests else 0
    d.update({k: v for k, v in errors_of(results).items() if k in ("short", "first_error")})
    return d
