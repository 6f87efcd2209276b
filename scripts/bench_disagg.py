#!/usr/bin/env python3
"""Benchmark: disaggregated `--role all` against `--role colocated`, and cached vs cold prefill.

One command, one run, same machine, same prompts:
  .venv/bin/python scripts/bench_disagg.py [--prompts 6] [--prompt-tokens 512] [--out-tokens 64]

Prints TTFT and decode tokens/s of both configurations with their ratio, and the TTFT of a
~2k-token prompt whose first 90% is already in the store against the same-length prompt cold.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx

from mooncake_testkit.launcher import Cluster, start_cluster

MODEL = "SmolLM2-135M-Instruct"


def token_prompt(n: int, seed: int) -> list[int]:
    """A deterministic prompt of exactly `n` token ids."""
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 40000) for _ in range(n)]


def stream_once(url: str, prompt: list[int], out_tokens: int) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s after the first token) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if not first:
                first = now
            last = now
            chunks += 1
    rate = (chunks - 1) / (last - first) if chunks > 1 and last > first else float("nan")
    return first - start, rate


def measure(cluster: Cluster, prompts: list[list[int]], out_tokens: int) -> dict[str, float]:
    """Median TTFT and decode rate over the prompts, one at a time."""
    stream_once(cluster.url, token_prompt(32, 999), 4)  # warm-up
    ttfts, rates = zip(*(stream_once(cluster.url, p, out_tokens) for p in prompts))
    return {"ttft": statistics.median(ttfts), "tps": statistics.median(rates)}


def cached_vs_cold(cluster: Cluster, total: int, reps: int) -> tuple[float, float]:
    """Median TTFT of a prompt with 90% of it cached in the store vs the same length cold."""
    cached_len = int(total * 0.9)
    warm, cold = [], []
    for i in range(reps):
        prefix = token_prompt(cached_len, 100 + i)
        stream_once(cluster.url, prefix + token_prompt(total - cached_len, 200 + i), 1)
        warm.append(stream_once(cluster.url, prefix + token_prompt(total - cached_len,
                                                                   300 + i), 1)[0])
        cold.append(stream_once(cluster.url, token_prompt(total, 400 + i), 1)[0])
    return statistics.median(warm), statistics.median(cold)


def main() -> None:
    """Run both configurations and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--cached-prompt-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    prompts = [token_prompt(args.prompt_tokens, s) for s in range(args.prompts)]

    results: dict[str, dict[str, float]] = {}
    for role in ("colocated", "all"):
        cluster = start_cluster(role)
        try:
            results[role] = measure(cluster, prompts, args.out_tokens)
            if role == "all":
                warm, cold = cached_vs_cold(cluster, args.cached_prompt_tokens, args.reps)
        finally:
            cluster.stop()

    a, c = results["all"], results["colocated"]
    print(f"\n{args.prompts} prompts x {args.prompt_tokens} tokens, {args.out_tokens} output "
          "tokens, one request at a time (medians)")
    print(f"{'config':<12}{'TTFT ms':>10}{'decode tok/s':>14}")
    for name, r in (("colocated", c), ("all", a)):
        print(f"{name:<12}{r['ttft'] * 1000:>10.1f}{r['tps']:>14.1f}")
    print(f"ratio all/colocated: TTFT {a['ttft'] / c['ttft']:.2f}x, "
          f"decode tok/s {a['tps'] / c['tps']:.2f}x")
    print(f"\n{args.cached_prompt_tokens}-token prompt, first 90% cached in the store:")
    print(f"TTFT cached {warm * 1000:.1f} ms, cold {cold * 1000:.1f} ms, "
          f"ratio cached/cold {warm / cold:.2f}x")


if __name__ == "__main__":
    main()
