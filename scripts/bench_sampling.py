#!/usr/bin/env python3
"""What sampling (temperature, top_p) adds to a token gap, against greedy decoding, in one run.

  .venv/bin/python scripts/bench_sampling.py [--role colocated] [--rounds 2]

Starts one server (`--role colocated`, default dtype) and alternates, `--rounds` times, greedy
and sampled runs of the same workloads: a lone 128-token stream, then 16 concurrent 128/128
streams. Prints each setting's token gap p50 and output tok/s with the ratio to greedy's, the
baseline measured in the same run. A server whose sampling costs nothing shows 1.00x.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake_bench import client as bs  # noqa: E402  (the checkout's package, installed or not)
from mooncake_bench import machine, systems, workloads  # noqa: E402

SETTINGS: dict[str, dict[str, Any] | None] = {
    "greedy": None,
    "temperature 1": {"temperature": 1.0, "seed": 1},  # OpenAI's defaults: top_p 1
    "t 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9, "seed": 1},
}
# Figures whose sampled / greedy ratio is reported: (key, label, higher is better)
FIGURES = (("lone_gap_s", "lone token gap", False), ("batch_gap_s", "16-stream TBT p50", False),
           ("batch_tok_s", "16-stream tok/s", True))


async def measure(api: bs.Api, prompts: bs.Prompts, sampling: dict[str, Any] | None,
                  tag: str) -> dict[str, float]:
    """A lone 128-token stream's median gap, then 16 concurrent 128/128 streams."""
    async with bs.new_client(300) as client:
        r = await bs.send(client, api, prompts.random(128, f"lone:{tag}"), 128, sampling)
    if r.status != "ok":
        raise RuntimeError(f"request failed: {r.error}")
    lone = statistics.median(b - a for a, b in zip(r.token_times, r.token_times[1:]))
    batch = await workloads.concurrent_workload(api, prompts, 16, 128, 128, 300, sampling)
    if batch["ok"] != batch["requests"]:
        raise RuntimeError(f"concurrent requests failed: {batch.get('errors')}")
    return {"lone_gap_s": lone, "batch_gap_s": batch["tbt_p50_gaps"],
            "batch_tok_s": batch["output_tok_s"]}


async def run_all(api: bs.Api, prompts: bs.Prompts, rounds: int) -> dict[str, list[dict]]:
    """Every setting once per round, interleaved so that drift on a shared host hits all."""
    async with bs.new_client(300) as client:
        await bs.send(client, api, prompts.random(128, "warm"), 8)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for rnd in range(rounds):
        for name, sampling in SETTINGS.items():
            runs[name].append(await measure(api, prompts, sampling, f"{rnd}:{name}"))
            print(f"round {rnd + 1}: {name} done", flush=True)
    return runs


def main() -> None:
    """Start the server, run every setting, print the table with ratios to greedy."""

    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--role", default="colocated", choices=("colocated", "all"))
        p.add_argument("--rounds", type=int, default=2)

    args, model, prompts = machine.one_server_bench(__doc__.splitlines()[0],
                                               "/tmp/bench_sampling_logs", flags)
    started = time.perf_counter()
    with systems.start_mooncake(args.role, ["--model", model], [], Path(args.logs)) as api:
        print(f"--role {args.role}: ready in {time.perf_counter() - started:.0f} s", flush=True)
        runs = asyncio.run(run_all(api, prompts, args.rounds))
    med = {name: {key: statistics.median(r[key] for r in rs) for key, _, _ in FIGURES}
           for name, rs in runs.items()}
    base = med["greedy"]
    print(f"\n{'setting':18}" + "".join(f"{label:>22}" for _, label, _ in FIGURES))
    for name, f in med.items():
        cells = []
        for key, _, _ in FIGURES:
            value = f"{f[key] * 1e3:.1f} ms" if key.endswith("_s") and "gap" in key \
                else f"{f[key]:.1f}"
            cells.append(f"{value} ({f[key] / base[key]:.2f}x)")
        print(f"{name:18}" + "".join(f"{c:>22}" for c in cells))
    worst = max(med[name][key] / base[key] if not higher else base[key] / med[name][key]
                for name in med if name != "greedy" for key, _, higher in FIGURES)
    print(f"\nworst sampled / greedy cost ratio: {worst:.2f}x (1.00x: sampling is free)")


if __name__ == "__main__":
    main()
