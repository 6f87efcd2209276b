#!/usr/bin/env python3
"""Single-stream decode speed of each --dtype/--quantization mode, against float32, in one run.

  .venv/bin/python scripts/bench_dtype.py [--modes auto,float32,bfloat16,int8] [--tokens 128]

Starts `--role colocated` once per mode (one after another, same weights, same prompt), streams
greedy completions of `--tokens` tokens from a 128-token prompt, and prints each mode's median
token gap and 256-token TTFT with the ratio to float32's. The first line names the CPU and the
flags that decide `auto` (what `auto` resolved to is in its start-up log).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake_bench import client as bs  # noqa: E402  (the checkout's package, installed or not)
from mooncake_bench import machine, systems  # noqa: E402

MODES = {
    "auto": [],  # what the server picks for this CPU
    "float32": ["--dtype", "float32", "--quantization", "none"],
    "bfloat16": ["--dtype", "bfloat16", "--quantization", "none"],
    "int8": ["--dtype", "float32", "--quantization", "int8"],
    "int8-weights": ["--dtype", "float32", "--quantization", "int8-weights"],
}


async def measure(api: bs.Api, prompts: bs.Prompts, tokens: int, reps: int) -> dict[str, float]:
    """Median token gap over `reps` lone streams, and the median TTFT of a 256-token prompt."""
    gaps: list[float] = []
    ttfts: list[float] = []
    async with bs.new_client(300) as client:
        await bs.send(client, api, prompts.random(128, "warm"), 8)
        for rep in range(reps):
            r = await bs.send(client, api, prompts.random(128, f"gap{rep}"), tokens)
            if r.status != "ok":
                raise RuntimeError(f"request failed: {r.error}")
            gaps += [b - a for a, b in zip(r.token_times, r.token_times[1:])]
            r = await bs.send(client, api, prompts.random(256, f"ttft{rep}"), 2)
            if r.status != "ok" or r.ttft_s is None:
                raise RuntimeError(f"request failed: {r.error}")
            ttfts.append(r.ttft_s)
    return {"gap_p50_s": statistics.median(gaps), "ttft256_p50_s": statistics.median(ttfts)}


def main() -> None:
    """Run every mode, then print the table with ratios to float32."""

    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--modes", default="auto,float32,bfloat16,int8")
        p.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
        p.add_argument("--reps", type=int, default=3)

    args, model, prompts = machine.one_server_bench(__doc__.splitlines()[0],
                                                    "/tmp/bench_dtype_logs", flags)
    figures: dict[str, dict[str, float]] = {}
    for mode in args.modes.split(","):
        started = time.perf_counter()
        with systems.start_mooncake("colocated", ["--model", model, *MODES[mode]], [],
                               Path(args.logs) / mode) as api:
            print(f"{mode}: ready in {time.perf_counter() - started:.0f} s", flush=True)
            figures[mode] = asyncio.run(measure(api, prompts, args.tokens, args.reps))
    base = figures.get("float32")
    print(f"\n{'mode':10} {'token gap p50':>14} {'vs fp32':>8} {'TTFT@256':>9} {'vs fp32':>8}")
    for mode, f in figures.items():
        gap_r = f["gap_p50_s"] / base["gap_p50_s"] if base else float("nan")
        ttft_r = f["ttft256_p50_s"] / base["ttft256_p50_s"] if base else float("nan")
        print(f"{mode:10} {f['gap_p50_s'] * 1e3:11.1f} ms {gap_r:7.2f}x "
              f"{f['ttft256_p50_s']:8.3f}s {ttft_r:7.2f}x")
    if base and "auto" in figures:
        r = figures["auto"]["gap_p50_s"] / base["gap_p50_s"]
        print(f"\n[{'PASS' if r <= 0.5 else 'FAIL'}] single-stream token gap auto / float32: "
              f"{r:.2f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
