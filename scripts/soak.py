#!/usr/bin/env python3
"""Soak run: many short requests through a whole cluster; nothing may leak.

  .venv/bin/python scripts/soak.py                    # 10,000 requests, ~10 min here
  .venv/bin/python scripts/soak.py --requests 2000 --concurrency 16

Starts a conductor, a store, a prefill and a decode instance as separate processes, warms
them up (--warmup requests), takes every role's RSS as the baseline, then sends --requests
short greedy completions from --concurrency clients (a fifth share one system prefix, so the
prefix cache is hit too), sampling RSS every tenth of the run. At the end the cluster must be
idle with nothing left in flight, leased, reserved or pinned, and every request answered.
Prints requests/s, failures, RSS per role at the baseline and the end (in all and its private,
anonymous part, where leaks show) and the private RSS growth per 1,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
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
_SHARED_PREFIX = [random.Random(7).randrange(1000, 40000) for _ in range(48)]


@dataclass
class SoakResult:
    """Everything one soak run measured."""

    requests: int
    ok: int
    failed: int
    errors: dict[str, int]  # status (or exception name) -> count
    seconds: float
    memory_before: dict[str, dict[str, int]]  # role -> rss / anon / shmem bytes
    memory_after: dict[str, dict[str, int]]
    anon_samples: list[dict[str, int]] = field(default_factory=list)  # every tenth of the run
    leftovers: dict[str, float] = field(default_factory=dict)

    def anon_growth_per_1000(self, role: str) -> float:
        """Private RSS growth of `role` per 1,000 requests, bytes (after minus before)."""
        before = self.memory_before[role]["anon"]
        after = self.memory_after.get(role, {}).get("anon", before)
        return (after - before) * 1000 / max(1, self.requests)


def prompt(rnd: random.Random) -> list[int]:
    """16-48 fresh tokens, after the shared prefix one time in five."""
    fresh = [rnd.randrange(1000, 40000) for _ in range(rnd.randrange(16, 48))]
    return (_SHARED_PREFIX + fresh) if rnd.random() < 0.2 else fresh


async def one(http: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> str | None:
    """One short completion (streamed or not, alternately); None if fine, else what failed."""
    stream = len(ids) % 2 == 0
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            raw = await r.aread()
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            if stream:
                return None if b"data: [DONE]" in raw else "stream cut"
            choices = json.loads(raw)["choices"]
            return None if choices[0]["finish_reason"] == "length" else "short answer"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def blast(cluster: RoleCluster, n: int, concurrency: int, max_tokens: int, seed: int,
                samples: list[dict[str, int]] | None = None) -> dict[str, int]:
    """`n` requests from `concurrency` clients; failures by kind."""
    rnd = random.Random(seed)
    errors: dict[str, int] = {}
    sent = 0
    step = max(1, n // 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as http:
        async def client() -> None:
            nonlocal sent
            while sent < n:
                sent += 1
                if samples is not None and sent % step == 0:
                    samples.append({k: v["anon"] for k, v in cluster.memory().items()})
                failure = await one(http, cluster.url, prompt(rnd), max_tokens)
                if failure is not None:
                    errors[failure] = errors.get(failure, 0) + 1
        await asyncio.gather(*[client() for _ in range(concurrency)])
    return errors


def launch(log_dir: Path) -> RoleCluster:
    """Conductor, store, prefill and decode as separate processes."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    cluster = RoleCluster(log_dir=log_dir, common=["--log-level", "warning"])
    cluster.add("conductor", "conductor")
    cluster.add("store", "store-0", "--memory", "256MiB")
    for role in ("prefill", "decode"):
        cluster.add(role, f"{role}-0", "--kv-memory", "256MiB", "--torch-threads", threads)
    return cluster.start()


def run_soak(cluster: RoleCluster, *, requests: int, concurrency: int, max_tokens: int,
             warmup: int, seed: int = 0) -> SoakResult:
    """Warm up, take the baseline, soak, wait until idle, measure again."""
    asyncio.run(blast(cluster, warmup, concurrency, max_tokens, seed))
    idle = cluster.free_blocks()
    cluster.wait_idle(idle)
    before = cluster.memory()
    samples: list[dict[str, int]] = []
    start = time.monotonic()
    errors = asyncio.run(blast(cluster, requests, concurrency, max_tokens, seed + 1, samples))
    seconds = time.monotonic() - start
    left = cluster.wait_idle(idle)
    failed = sum(errors.values())
    return SoakResult(requests, requests - failed, failed, errors, seconds, before,
                      cluster.memory(), samples, left)


def print_result(r: SoakResult) -> None:
    """The figures."""
    print(f"{r.requests} requests in {r.seconds:.0f} s ({r.requests / r.seconds:.1f} req/s): "
          f"{r.ok} ok, {r.failed} failed {r.errors or ''}")
    # shmem is the KV pool / registered buffers, resident as their pages are first touched
    # (bounded by the configured sizes); anon is the heap, where a leak would show.
    print(f"{'role':<12}{'RSS before':>11}{'after':>8}{'ratio':>7}{'anon before':>13}"
          f"{'after':>8}{'ratio':>7}{'shmem before':>14}{'after':>8}"
          f"{'anon growth / 1k req':>22}")
    for name, b in r.memory_before.items():
        a = r.memory_after.get(name, {})
        print(f"{name:<12}{b['rss'] / MiB:>9.0f}Mi{a.get('rss', 0) / MiB:>6.0f}Mi"
              f"{a.get('rss', 0) / b['rss']:>7.3f}{b['anon'] / MiB:>11.0f}Mi"
              f"{a.get('anon', 0) / MiB:>6.0f}Mi{a.get('anon', 0) / b['anon']:>7.3f}"
              f"{b.get('shmem', 0) / MiB:>12.0f}Mi{a.get('shmem', 0) / MiB:>6.0f}Mi"
              f"{r.anon_growth_per_1000(name) / MiB:>20.2f}Mi")
    if r.anon_samples:
        print("anon RSS (MiB) every tenth of the run:")
        for name in r.memory_before:
            print(f"  {name:<12}" + " ".join(f"{s.get(name, 0) / MiB:.0f}"
                                             for s in r.anon_samples))
    print("left in flight / pinned after the run:", r.leftovers or "nothing")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--log-dir", help="role logs (default: a temporary directory)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Launch, run, print."""
    a = build_parser().parse_args(argv)
    log_dir = Path(a.log_dir or mkdtemp(prefix="mooncake-soak-"))
    with launch(log_dir) as cluster:
        result = run_soak(cluster, requests=a.requests, concurrency=a.concurrency,
                          max_tokens=a.max_tokens, warmup=a.warmup)
    print_result(result)
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(result), indent=2))
    sys.exit(0 if result.failed == 0 and not result.leftovers else 1)


if __name__ == "__main__":
    main()
