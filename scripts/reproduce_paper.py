#!/usr/bin/env python3
"""Reproduce the Mooncake paper's scheduling and cache figures at CPU scale, in one command.

  .venv/bin/python scripts/reproduce_paper.py --quick           # ~15 min on 2 cores
  .venv/bin/python scripts/reproduce_paper.py                   # the full run
  .venv/bin/python scripts/reproduce_paper.py --resume paper-report/20261204-163000

Steps (each writes its points to the report folder; `--resume` skips those already there):
  cache     Fig. 9/10, Table 2: hit rate of one global pool against per-instance local caches
            over capacity, by the trace-driven simulator on the store's own code
            (mooncake_bench/cache_sim.py), on `--cache-trace` (default: the synthetic trace
            shipped in traces/; pass the paper's full traces from Mooncake's repository).
  policies  Fig. 5: mean and p90 TTFT of the conductor's four placement policies (random, load,
            cache-local, cache-global = Algorithm 1) on the same arrivals, 2 prefill + 1 decode
            instances sharing the cores (scripts/replay_trace.py --launch 2p1d:<policy>).
  goodput   Fig. 11-14: share of requests within SLO as arrivals speed up, `--role all` with SLO
            flags against `--role colocated` (scripts/bench_goodput.py), or `--goodput` to take
            an earlier run's goodput.json.
Then report.md sets each figure beside the paper's numbers, with the scale, and every claim the
script checks printed as HOLDS or DIFFERS.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mooncake_bench import paper  # noqa: E402  (the checkout's package, installed or not)
from mooncake_bench.cache_sim import (  # noqa: E402
    MODES,
    request_keys,
    reused_share_of_keys,
    simulate_keys,
)
from mooncake_bench.machine import cpu_info  # noqa: E402
from mooncake_bench.report import line_chart, pyplot  # noqa: E402
from mooncake_bench.trace import SYNTHETIC_TRACE, load_trace  # noqa: E402

SCRIPTS = ROOT / "scripts"
STEPS = ("cache", "policies", "goodput")
POLICIES = ("random", "load", "cache-local", "cache-global")


def run_cache(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Hit rates of every mode over capacities (seconds per point, no model)."""
    # The store warns of each refused key; a simulated cache smaller than a request refuses many.
    logging.getLogger("mooncake_server.roles.store.objects").setLevel(logging.ERROR)
    # Each request's keys are hashed once for every point.
    keys = [request_keys(r.hash_ids)
            for r in load_trace(args.cache_trace, 0, args.cache_requests)]
    caps = [int(c) for c in args.capacities.split(",")]
    points = []
    for cap in tqdm(caps, desc="cache capacities", leave=False):
        for mode in MODES:
            r = simulate_keys(keys, cap, mode=mode, nodes=args.nodes)
            points.append({"mode": mode, "capacity_blocks": r.capacity_blocks,
                           "hit_rate": r.hit_rate, "hits": r.hits})
    return {"trace": str(args.cache_trace), "requests": len(keys),
            "blocks": sum(len(k) for k in keys), "nodes": args.nodes,
            "reused_share": reused_share_of_keys(keys), "points": points}


def run_policies(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One replay per policy on the same arrivals; mean / p90 TTFT and hit rate of each."""
    raw = out / "policies-replay.json"
    launches = ",".join(f"2p1d:{p}" for p in POLICIES)
    cmd = [sys.executable, str(SCRIPTS / "replay_trace.py"), "--launch", launches,
           "--trace", args.policy_trace, "--start", str(args.policy_start),
           "--max-requests", str(args.policy_requests), "--time-scale", str(args.time_scale),
           "--block-tokens", "16", "--max-output-tokens", "16", "--json", str(raw),
           # A decode's default KV pool (512 MiB, ~11k tokens here) refused half of 80 requests
           # (429) under every policy: the comparison was of refusals, not of placement.
           "--decode-arg=--kv-memory=4GiB",
           "--report", str(out / "policies-replay"), "--logs", str(out / "logs" / "policies")]
    subprocess.run(cmd, check=True)
    summaries = json.loads(raw.read_text())
    data: dict[str, Any] = {}
    for name, s in summaries.items():
        policy = name.split(":", 1)[-1]
        data[policy] = {"ttft_mean": s["ttft_mean"], "ttft_p90": s["ttft_p90"],
                        "cache_hit_rate": s.get("cache_hit_rate"), "ok": s.get("ok")}
    return data


def run_goodput(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """bench_goodput's points for `--role all` with SLOs and `--role colocated` (or a given run)."""
    if args.goodput:
        given = Path(args.goodput)
        if given.with_name("goodput.png").exists():
            shutil.copy(given.with_name("goodput.png"), out / "goodput.png")
        return json.loads(given.read_text())
    folder = out / "goodput-run"
    cmd = [sys.executable, str(SCRIPTS / "bench_goodput.py"), "--systems", "all-slo,colocated",
           "--scales", args.goodput_scales, "--requests", str(args.goodput_requests),
           "--out", str(folder),
           "--logs", str(out / "logs" / "goodput")]
    subprocess.run(cmd, check=True)
    shutil.copy(folder / "goodput.png", out / "goodput.png")
    return json.loads((folder / "goodput.json").read_text())


def plot_cache(data: dict[str, Any], path: Path) -> None:
    """Hit rate against total capacity, one line per mode (Fig. 9/10 style)."""
    line_chart(path, {mode: [(p["capacity_blocks"], p["hit_rate"]) for p in data["points"]
                             if p["mode"] == mode] for mode in MODES},
               "cache capacity, all nodes (blocks)", "prefix-cache hit rate (blocks)",
               ylim=(0.0, 1.0), xlog=True)


def plot_policies(data: dict[str, Any], path: Path) -> None:
    """Mean TTFT per policy beside the paper's (Fig. 5 style)."""
    plt = pyplot()
    names = [p for p in POLICIES if p in data]
    fig, (ours, theirs) = plt.subplots(1, 2, figsize=(8, 3.5))
    ours.bar(names, [data[p]["ttft_mean"] for p in names])
    ours.set_title("ours (CPU scale)")
    theirs.bar(names, [paper.PAPER_POLICY_TTFT_S[p] for p in names], color="grey")
    theirs.set_title("paper, Fig. 5")
    for ax in (ours, theirs):
        ax.set_ylabel("mean TTFT (s)")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--quick", action="store_true", help="fewer points (under 15 min on 2 cores)")
    p.add_argument("--out", default=None, help="report folder (default paper-report/<time>)")
    p.add_argument("--resume", default=None, help="a report folder: steps done there are kept")
    p.add_argument("--steps", default=",".join(STEPS), help="which steps to run")
    p.add_argument("--cache-trace", default=str(SYNTHETIC_TRACE))
    p.add_argument("--cache-requests", type=int, default=None, help="first N requests only")
    p.add_argument("--capacities", default=None, help="total cache capacities, in blocks")
    p.add_argument("--nodes", type=int, default=4, help="store nodes / local caches")
    p.add_argument("--policy-trace", default=str(SYNTHETIC_TRACE))
    # The trace's last stretch: 29% of its blocks repeat within 80 requests there, under 10% in
    # earlier ones (its reuse is mostly far apart), where placement by cache has little to find.
    p.add_argument("--policy-start", type=int, default=3600)
    p.add_argument("--policy-requests", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--goodput", default=None, help="an earlier bench_goodput goodput.json")
    p.add_argument("--goodput-scales", default=None)
    p.add_argument("--goodput-requests", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    """Run the steps not done yet, then write the report."""
    args = build_parser().parse_args(argv)
    args.capacities = args.capacities or ("250,1000,4000,16000" if args.quick
                                          else "125,250,500,1000,2000,4000,8000,16000,32000")
    args.policy_requests = args.policy_requests or (24 if args.quick else 80)
    args.goodput_scales = args.goodput_scales or ("4" if args.quick else "16,4,2")
    args.goodput_requests = args.goodput_requests or (40 if args.quick else 60)
    out = Path(args.resume or args.out or time.strftime("paper-report/%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    runners = {"cache": run_cache, "policies": run_policies, "goodput": run_goodput}
    sections: dict[str, Any] = {}
    wanted = [s for s in args.steps.split(",") if s]
    for step in tqdm(wanted, desc="paper figures"):
        done = out / f"{step}.json"
        if args.resume and done.exists():
            sections[step] = json.loads(done.read_text())
            tqdm.write(f"{step}: kept from {done}")
            continue
        t0 = time.perf_counter()
        sections[step] = runners[step](args, out)
        done.write_text(json.dumps(sections[step], indent=1))
        tqdm.write(f"{step}: {time.perf_counter() - t0:.0f} s")
    if "cache" in sections:
        plot_cache(sections["cache"], out / "cache.png")
    if "policies" in sections:
        plot_policies(sections["policies"], out / "policies.png")
    claims = []
    if "policies" in sections:
        claims += paper.policy_claims({k: v["ttft_mean"] for k, v in sections["policies"].items()})
    if "cache" in sections:
        claims += paper.cache_claims(sections["cache"]["points"])
    if "goodput" in sections:
        claims += paper.goodput_claims(sections["goodput"]["points"])
    scale = {"model": "SmolLM2-135M-Instruct (bundled GGUF, default dtype)",
             "machine": _cpu(cpu_info()),
             "serving blocks": "16 tokens per trace block (512 in the paper)",
             "policy runs": f"{args.policy_requests} requests from line {args.policy_start} of "
                            f"{args.policy_trace}, time scale {args.time_scale:g}, outputs <= 16, "
                            "2 prefill + 1 decode instances on the same cores",
             "cache runs": f"{args.nodes} nodes / local caches, LRU and watermark of the store"}
    report = paper.write_report(out, scale, sections, claims)
    for c in claims:
        print(f"{c.verdict:7} {c.figure:11} {c.text}: {c.evidence}")
    print(f"report: {report}")


def _cpu(info: dict[str, Any]) -> str:
    """The CPU in one line: model, cores, the flags that decide inference speed it has."""
    present = [f for f, on in info["flags"].items() if on]
    return f"{info['model']}, {info['cores']} cores, {' '.join(present)}"


if __name__ == "__main__":
    main()
