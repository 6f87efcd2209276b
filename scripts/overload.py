#!/usr/bin/env python3
"""Overload run: arrivals at a multiple of the sustainable rate; early rejection keeps SLOs.

  .venv/bin/python scripts/overload.py                      # 2x for 60 s, ~2.5 min in all
  .venv/bin/python scripts/overload.py --duration 20 --factor 3

Starts a conductor (with --ttft-slo / --tbt-slo), a store, a prefill and a decode instance as
separate processes, then in one run:
  1. calibration: a closed loop of --concurrency clients (enough to saturate the cluster; a
     429 makes a client wait its Retry-After) for --calibrate seconds: the requests per second
     the cluster completes while admitting only what meets its SLOs are the sustainable rate,
     their TTFT / TBT the baseline;
  2. RSS of every role (the baseline, after calibration warmed every allocator);
  3. overload: Poisson arrivals at --factor x the sustainable rate for --duration seconds;
  4. the cluster drains: nothing left in flight, pinned or reserved; RSS again.
Prints accepted / rejected (429, with Retry-After) / failed requests, how fast rejections came,
SLO attainment of accepted requests against calibration, and RSS after / before per role.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import mkdtemp

import httpx

from mooncake_testkit.role_procs import RoleCluster

MODEL = "SmolLM2-135M-Instruct"
MiB = 1 << 20


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int = 0  # HTTP status; 0 = transport error
    retry_after: float | None = None  # seconds, from a 429's Retry-After header
    answered_s: float = 0.0  # time to the status line (a 429 arrives here)
    ttft_s: float | None = None
    tbt_s: float | None = None  # mean of the longest 10% gaps after the second token
    tokens: int = 0
    complete: bool = False  # the stream ended with a finish reason


def request_tbt(times: Sequence[float]) -> float | None:
    """Mean of the longest 10% of a request's gaps after its second token (the gap before it is
    the hand-off to decode), as the conductor judges it (scheduler/outcomes.py)."""
    from mooncake_server.roles.conductor.scheduler.outcomes import longest_tenth_mean

    return longest_tenth_mean([b - a for a, b in itertools.pairwise(times[1:])])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def send(http: httpx.AsyncClient, url: str, prompt: list[int],
               max_tokens: int) -> Outcome:
    """One streamed greedy completion; never raises."""
    out = Outcome()
    start = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times: list[float] = []
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            out.status = r.status_code
            out.answered_s = time.monotonic() - start
            if "retry-after" in r.headers:
                out.retry_after = float(r.headers["retry-after"])
            if r.status_code != 200:
                await r.aread()
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        times.append(time.monotonic())
                    if choice.get("finish_reason"):
                        out.complete = True
    except (httpx.HTTPError, ValueError):
        out.status = out.status or 0
    out.tokens = len(times)
    if times:
        out.ttft_s = times[0] - start
        out.tbt_s = request_tbt(times)
    return out


def random_prompt(rnd: random.Random, n: int) -> list[int]:
    """`n` ordinary token ids (no two requests share a prefix)."""
    return [rnd.randrange(1000, 40000) for _ in range(n)]


async def closed_loop(url: str, seconds: float, concurrency: int, prompt_tokens: int,
                      max_tokens: int, seed: int) -> tuple[list[Outcome], float]:
    """`concurrency` clients back to back for `seconds`; outcomes and elapsed time."""
    rnd = random.Random(seed)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + seconds
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as http:
        async def client() -> None:
            while time.monotonic() < deadline:
                out = await send(http, url, random_prompt(rnd, prompt_tokens), max_tokens)
                outcomes.append(out)
                if out.retry_after is not None:  # a polite client waits as told
                    await asyncio.sleep(min(out.retry_after, deadline - time.monotonic()))
        await asyncio.gather(*[client() for _ in range(concurrency)])
    return outcomes, time.monotonic() - start


async def open_loop(url: str, rate: float, seconds: float, prompt_tokens: int,
                    max_tokens: int, seed: int) -> list[Outcome]:
    """Poisson arrivals at `rate` per second for `seconds`; every request's outcome."""
    rnd = random.Random(seed)
    tasks: list[asyncio.Task[Outcome]] = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10),
                                 limits=limits) as http:
        start = time.monotonic()
        t = 0.0
        while True:
            t += rnd.expovariate(rate)
            if t >= seconds:
                break
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(
                send(http, url, random_prompt(rnd, prompt_tokens), max_tokens)))
        return list(await asyncio.gather(*tasks))


@dataclass
class Phase:
    """Summary of one phase's outcomes."""

    requests: int
    accepted: int
    rejected: int
    rejected_with_retry_after: int
    failed: int  # 5xx, transport errors, or accepted streams that did not complete
    reject_p50_ms: float
    reject_p99_ms: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    within_slo: float  # share of accepted requests within both SLOs


def summarize(outcomes: Sequence[Outcome], ttft_slo: float, tbt_slo: float) -> Phase:
    """Counts and percentiles of one phase."""
    accepted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status == 429]
    failed = [o for o in outcomes if o.status not in (200, 429)] + [
        o for o in accepted if not o.complete]
    ttft = [o.ttft_s for o in accepted if o.ttft_s is not None]
    tbt = [o.tbt_s for o in accepted if o.tbt_s is not None]
    within = [o for o in accepted if o.complete and o.ttft_s is not None
              and o.ttft_s <= ttft_slo and (o.tbt_s or 0.0) <= tbt_slo]
    return Phase(
        len(outcomes), len(accepted), len(rejected),
        sum(o.retry_after is not None for o in rejected),
        len(failed), 1000 * percentile([o.answered_s for o in rejected], 50),
        1000 * percentile([o.answered_s for o in rejected], 99), percentile(ttft, 50),
        percentile(ttft, 99), percentile(tbt, 50), percentile(tbt, 99),
        len(within) / len(accepted) if accepted else float("nan"))


@dataclass
class OverloadResult:
    """Everything one overload run measured."""

    sustainable_rps: float
    offered_rps: float
    calibration: Phase
    overload: Phase
    memory_before: dict[str, dict[str, int]]  # role -> rss / anon / shmem bytes
    memory_after: dict[str, dict[str, int]]
    leftovers: dict[str, float] = field(default_factory=dict)  # non-zero = something leaked


def launch(ttft_slo: float, tbt_slo: float, log_dir: Path) -> RoleCluster:
    """Conductor (with the SLOs), store, prefill and decode as separate processes."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    cluster = RoleCluster(log_dir=log_dir, common=["--log-level", "warning"])
    cluster.add("conductor", "conductor", "--ttft-slo", str(ttft_slo), "--tbt-slo", str(tbt_slo))
    cluster.add("store", "store-0", "--memory", "512MiB")
    for role in ("prefill", "decode"):
        cluster.add(role, f"{role}-0", "--kv-memory", "256MiB", "--torch-threads", threads)
    return cluster.start()


def run_overload(cluster: RoleCluster, *, duration_s: float, factor: float, calibrate_s: float,
                 concurrency: int, prompt_tokens: int, max_tokens: int, ttft_slo: float,
                 tbt_slo: float, seed: int = 0) -> OverloadResult:
    """Calibrate, then overload `cluster` (already started with the SLOs)."""
    url = cluster.url
    asyncio.run(closed_loop(url, 3.0, 1, prompt_tokens, max_tokens, seed))  # warm-up
    idle = cluster.free_blocks()
    calib, elapsed = asyncio.run(closed_loop(url, calibrate_s, concurrency, prompt_tokens,
                                             max_tokens, seed + 1))
    done = sum(1 for o in calib if o.status == 200 and o.complete)
    sustainable = max(done / elapsed, 0.1)
    cluster.wait_idle(idle)
    memory_before = cluster.memory()
    offered = factor * sustainable
    over = asyncio.run(open_loop(url, offered, duration_s, prompt_tokens, max_tokens, seed + 2))
    left = cluster.wait_idle(idle)
    return OverloadResult(sustainable, offered, summarize(calib, ttft_slo, tbt_slo),
                          summarize(over, ttft_slo, tbt_slo), memory_before, cluster.memory(),
                          left)


def print_result(r: OverloadResult, duration_s: float, factor: float) -> None:
    """The figures, with ratios against the calibration (baseline) phase."""
    c, o = r.calibration, r.overload
    print(f"sustainable rate (calibration, closed loop): {r.sustainable_rps:.2f} req/s")
    print(f"offered: {r.offered_rps:.2f} req/s = {factor:g}x for {duration_s:g} s "
          f"-> {o.requests} requests")
    print(f"{'phase':<12}{'sent':>6}{'ok':>6}{'429':>6}{'+RA':>6}{'fail':>6}"
          f"{'TTFT p50':>10}{'p99':>8}{'TBT p50':>9}{'p99':>8}{'in SLO':>8}")
    for name, p in (("calibration", c), ("overload", o)):
        print(f"{name:<12}{p.requests:>6}{p.accepted:>6}{p.rejected:>6}"
              f"{p.rejected_with_retry_after:>6}{p.failed:>6}{p.ttft_p50_s:>10.3f}"
              f"{p.ttft_p99_s:>8.3f}{p.tbt_p50_s:>9.3f}{p.tbt_p99_s:>8.3f}"
              f"{p.within_slo:>8.0%}")
    print(f"429s answered in p50 {o.reject_p50_ms:.1f} ms / p99 {o.reject_p99_ms:.1f} ms "
          f"(vs. accepted TTFT p50 {1000 * o.ttft_p50_s:.0f} ms)")
    print(f"accepted TTFT p99 / calibration: {o.ttft_p99_s / c.ttft_p99_s:.2f}x, "
          f"TBT p99 / calibration: {o.tbt_p99_s / c.tbt_p99_s:.2f}x")
    print_memory(r.memory_before, r.memory_after)
    print("left in flight / pinned after the run:", r.leftovers or "nothing")


def print_memory(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> None:
    """RSS per role before / after, in all and its private (anon) part, with ratios."""
    print(f"{'role':<12}{'RSS before':>11}{'after':>8}{'ratio':>7}"
          f"{'anon before':>13}{'after':>8}{'ratio':>7}{'shmem before':>14}{'after':>8}")
    for name, b in before.items():
        a = after.get(name, {})
        print(f"{name:<12}{b['rss'] / MiB:>9.0f}Mi{a.get('rss', 0) / MiB:>6.0f}Mi"
              f"{a.get('rss', 0) / b['rss']:>7.3f}{b['anon'] / MiB:>11.0f}Mi"
              f"{a.get('anon', 0) / MiB:>6.0f}Mi{a.get('anon', 0) / b['anon']:>7.3f}"
              f"{b.get('shmem', 0) / MiB:>12.0f}Mi{a.get('shmem', 0) / MiB:>6.0f}Mi")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="overload seconds (60)")
    p.add_argument("--factor", type=float, default=2.0, help="x the sustainable rate (2)")
    p.add_argument("--calibrate", type=float, default=30.0, help="calibration seconds (30)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="calibration clients, enough to saturate the cluster (16)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (2)")
    p.add_argument("--tbt-slo", type=float, default=0.5, help="seconds (0.5)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--log-dir", help="role logs (default: a temporary directory)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Launch, run, print."""
    a = build_parser().parse_args(argv)
    log_dir = Path(a.log_dir or mkdtemp(prefix="mooncake-overload-"))
    with launch(a.ttft_slo, a.tbt_slo, log_dir) as cluster:
        result = run_overload(cluster, duration_s=a.duration, factor=a.factor,
                              calibrate_s=a.calibrate, concurrency=a.concurrency,
                              prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens,
                              ttft_slo=a.ttft_slo, tbt_slo=a.tbt_slo)
    print_result(result, a.duration, a.factor)
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(result), indent=2))
    sys.exit(0 if result.overload.failed == 0 and not result.leftovers else 1)


if __name__ == "__main__":
    main()
