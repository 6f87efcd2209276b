#!/usr/bin/env python3
"""Benchmark: layer-wise KV streaming (`--kv-write layer`) against writing whole blocks after the
forward pass (`--kv-write after`), on the same prompts, in one run, for each transport.

  .venv/bin/python scripts/bench_layerwise.py [--prompts 5] [--prompt-tokens 2000] \\
      [--transports shm,tcp]

Each configuration is a `--role all` cluster. Every prompt is new (nothing cached), asks for one
token, so its time to first token is prefill compute + moving its KV to the store + put_end:
exactly what layer-wise streaming overlaps. Prints the median TTFT and prefill job time of both
modes and their ratio (layer / after) per transport, and the bytes each prompt moved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx

from mooncake_testkit.launcher import Cluster, start_cluster

MODEL = "SmolLM2-135M-Instruct"
_PREFILL_OFFSET = 2  # --role all: prefill listens on port + 2


def token_prompt(n: int, seed: int) -> list[int]:
    """A deterministic prompt of exactly `n` token ids."""
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 40000) for _ in range(n)]


def prefill_seconds(cluster: Cluster) -> float:
    """`mooncake_prefill_seconds_sum` of the cluster's prefill instance."""
    text = httpx.get(cluster.role_url(_PREFILL_OFFSET) + "/metrics",
                     headers=cluster.internal_headers, timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("mooncake_prefill_seconds_sum"))


def measure(cluster: Cluster, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    """(TTFT, prefill job seconds) of each prompt, one at a time."""
    ttfts, jobs = [], []
    for prompt in prompts:
        before = prefill_seconds(cluster)
        start = time.perf_counter()
        r = httpx.post(cluster.url + "/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        ttfts.append(time.perf_counter() - start)
        jobs.append(prefill_seconds(cluster) - before)
    return ttfts, jobs


def main() -> None:
    """Run both modes per transport and print the ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads per engine (default: all cores). Fewer than the cores "
                        "leaves one to the transfer engine, as a NIC / DMA engine would be")
    args = p.parse_args()
    rows = []
    for transport in [t for t in args.transports.split(",") if t]:
        results = {}
        for mode in ("after", "layer"):
            extra = ["--kv-write", mode, "--transport", transport,
                     "--prefill-chunk", str(args.prefill_chunk)]
            if args.torch_threads:
                extra += ["--torch-threads", str(args.torch_threads)]
            cluster = start_cluster("all", extra)
            try:
                measure(cluster, [token_prompt(64, 1)])  # warm-up
                # Same prompts for both modes; new to each cluster (its store starts empty).
                prompts = [token_prompt(args.prompt_tokens, 100 + i) for i in range(args.prompts)]
                results[mode] = measure(cluster, prompts)
            finally:
                cluster.stop()
            ttft, job = (statistics.median(x) for x in results[mode])
            print(f"{transport:>4} {mode:>5}: TTFT p50 {ttft * 1000:7.1f} ms, prefill job p50 "
                  f"{job * 1000:7.1f} ms", flush=True)
        after_t, after_j = (statistics.median(x) for x in results["after"])
        layer_t, layer_j = (statistics.median(x) for x in results["layer"])
        rows.append((transport, layer_t / after_t, layer_j / after_j, after_t - layer_t))
    kv_mb = args.prompt_tokens * 46080 / 1e6  # SmolLM2-135M, float32: 46,080 B per token
    threads = f"{args.torch_threads} torch thread(s)" if args.torch_threads else "all cores"
    print(f"\n{args.prompt_tokens}-token prompts (~{kv_mb:.0f} MB of KV each), "
          f"{args.prompts} per mode, median, {threads}")
    for transport, ttft_ratio, job_ratio, saved in rows:
        print(f"{transport}: layer-wise / after: TTFT {ttft_ratio:.2f}x, prefill job "
              f"{job_ratio:.2f}x (layer-wise {'saves' if saved >= 0 else 'costs'} "
              f"{abs(saved) * 1000:.0f} ms per prompt)")


if __name__ == "__main__":
    main()
