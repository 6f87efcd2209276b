#!/usr/bin/env python3
"""Benchmark mooncake-server (`--role all`, `--role colocated`) against `transformers serve`.

  .venv/bin/python scripts/bench_serving.py --out results.json
  .venv/bin/python scripts/bench_serving.py --quick --systems colocated,tfserve
  .venv/bin/python scripts/bench_serving.py --mooncake-args "--dtype bfloat16" \\
      --tf-args "--dtype bfloat16"

In one run each system is started in turn (never two at once) on the same local safetensors
weights, sent the same prompts through /v1/completions (streamed, greedy, exact output lengths),
and stopped with its whole process tree before the next one starts:
  1. TTFT of single requests with 256 / 1024 / 4096-token prompts (p50 of 3 distinct prompts);
  2. 16 concurrent requests, 128-token prompts, 128 output tokens: output tok/s (all output
     tokens / wall time), TBT p50 over every inter-token gap and the paper's per-request TBT
     (mean of a request's longest 10% gaps) p50;
  3. the first 100 requests of the Mooncake trace (traces/mooncake_sample.jsonl), replayed
     with scripts/replay_trace.py's prompts (hash-id block = 16 tokens, outputs capped at
     128) at --time-scale x the trace's gaps, SLOs TTFT <= 5 s and TBT <= 200 ms; `--role
     all` gets those SLOs as flags (429 = rejected = not served). Effective capacity = share
     of the trace answered within both SLOs.
Then one table per workload, the issue's target ratios with PASS/FAIL, and --out as JSON.

Prompts are token ids of single-token words (" word"): their text tokenizes back to exactly the
same ids, so transformers serve, whose /v1/completions takes only string prompts, computes the
same tokens that mooncake-server is given as ids. transformers serve rejects `ignore_eos`
(422); it gets `generation_config` = '{"max_new_tokens": N, "eos_token_id": -1}' (a JSON
string) for exact lengths instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_bench import trace as rt  # noqa: E402  (the checkout's package, installed or not)
from mooncake_bench.client import (  # noqa: E402
    Api,
    Prompts,
    warm_up,
)
from mooncake_bench.machine import cpu_info, print_cpu  # noqa: E402
from mooncake_bench.report import json_safe  # noqa: E402
from mooncake_bench.systems import launch_system, load_avg  # noqa: E402
from mooncake_bench.workloads import (  # noqa: E402
    concurrent_workload,
    offered_load,
    replay,
    replay_summary,
    ttft_workload,
)

SYSTEMS = ("all", "colocated", "tfserve")
WORKLOADS = ("ttft", "concurrent", "replay")

# Full run, and what --quick shrinks it to (explicit flags win over both).
FULL = {"ttft_sizes": "256,1024,4096", "ttft_reps": 3, "concurrency": 16,
        "concurrent_prompt_tokens": 128, "concurrent_output_tokens": 128, "max_requests": 100}
QUICK = {"ttft_sizes": "64", "ttft_reps": 3, "concurrency": 4, "concurrent_prompt_tokens": 64,
         "concurrent_output_tokens": 16, "max_requests": 10}

# ---------------------------------------------------------------------------------------------
# Running one system


def run_system(name: str, args: argparse.Namespace, prompts: Prompts,
               trace: list[rt.TraceRequest], log_dir: Path) -> dict[str, Any]:
    """Every selected workload against one system; its figures (or its error)."""
    out: dict[str, Any] = {}
    sizes = [int(s) for s in args.ttft_sizes.split(",") if s.strip()]
    micro = [w for w in ("ttft", "concurrent") if w in args.workloads]
    # `all` has its SLO admission control on for the replay only: TTFT and throughput are raw
    # speed, and a lone 4096-token prefill may already be estimated above 5 s on a small CPU.
    phases = ([("micro", micro)] if micro else []) + (
        [("replay", ["replay"])] if "replay" in args.workloads else [])
    if name != "all" and len(phases) == 2:
        phases = [("every", micro + ["replay"])]
    for phase, workloads in phases:
        slo = phase == "replay" and name == "all"
        label = f"{name}{' (with --ttft-slo/--tbt-slo)' if slo else ''}"
        print(f"starting {label} ...", flush=True)
        t0 = time.perf_counter()
        try:
            with launch_system(name, args, log_dir, slo) as api:
                api.prompts = prompts
                print(f"  ready in {time.perf_counter() - t0:.0f} s at {api.url} "
                      f"(model {api.model})", flush=True)
                asyncio.run(warm_up(api, prompts, max(sizes) if "ttft" in workloads else 128,
                                    args.request_timeout))
                for w in workloads:
                    t1 = time.perf_counter()
                    before = load_avg()
                    out[w] = run_workload(w, api, args, prompts, trace, sizes)
                    # Other work on the machine skews one system and not the next: keep the
                    # load next to each figure.
                    out.setdefault("load_avg_1m", {})[w] = [before, load_avg()]
                    print(f"  {w}: {time.perf_counter() - t1:.0f} s (load average {before:.1f}"
                          f" -> {load_avg():.1f})", flush=True)
                t2 = time.perf_counter()
            print(f"  stopped in {time.perf_counter() - t2:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - one broken system must not lose the others
            print(f"  {label} failed: {exc}", file=sys.stderr, flush=True)
            out.setdefault("errors", []).append(f"{phase}: {exc}")
    return out


def run_workload(w: str, api: Api, args: argparse.Namespace, prompts: Prompts,
                 trace: list[rt.TraceRequest], sizes: list[int]) -> dict[str, Any]:
    """One workload's figures against a started system."""
    if w == "ttft":
        return asyncio.run(ttft_workload(api, prompts, sizes, args.ttft_reps,
                                         args.ttft_max_tokens, args.request_timeout))
    if w == "concurrent":
        return asyncio.run(concurrent_workload(api, prompts, args.concurrency,
                                               args.concurrent_prompt_tokens,
                                               args.concurrent_output_tokens,
                                               args.request_timeout))
    start = time.perf_counter()
    results = asyncio.run(replay(api, prompts, trace, args.block_tokens, args.seed,
                                 args.time_scale, args.max_output_tokens, args.request_timeout))
    return replay_summary(results, args.ttft_slo, args.tbt_slo, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Tables and targets


def ratio(a: float | None, b: float | None) -> float:
    """a / b; nan when either is missing or both are zero, inf when only b is zero."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return float("nan")
    if b == 0:
        return float("inf") if a > 0 else float("nan")
    return a / b


@dataclass
class Target:
    """One of the issue's targets: `value` (a ratio or share) against `bound`."""

    name: str
    value: float
    op: str  # "<=" | ">="
    bound: float
    unit: str = "x"  # "x" for ratios, "%" for shares
    note: str = ""

    @property
    def verdict(self) -> str:
        """PASS, FAIL, or n/a when a figure is missing."""
        if math.isnan(self.value):
            return "n/a"
        ok = self.value <= self.bound if self.op == "<=" else self.value >= self.bound
        return "PASS" if ok else "FAIL"

    def line(self) -> str:
        """`[PASS] name: 0.62x (target <= 0.8x)`."""
        if self.unit == "%":
            val = "n/a" if math.isnan(self.value) else f"{self.value:.1%}"
            bound = f"{self.bound:.0%}"
        else:
            val = "n/a" if math.isnan(self.value) else f"{self.value:.2f}x"
            bound = f"{self.bound:g}x"
        note = f"  [{self.note}]" if self.note else ""
        return f"[{self.verdict:>4}] {self.name}: {val} (target {self.op} {bound}){note}"


def _get(results: dict[str, Any], system: str, *keys: str) -> float:
    node: Any = results.get(system, {})
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return float("nan")
        node = node[k]
    return float(node) if isinstance(node, (int, float)) else float("nan")


def targets(results: dict[str, Any], sizes: Sequence[int]) -> list[Target]:
    """The issue's ratios from the measured figures (n/a where a system or workload is missing)."""
    out: list[Target] = []
    for n in sizes:
        a, c, t = (_get(results, s, "ttft", str(n), "ttft_p50") for s in SYSTEMS)
        out.append(Target(f"TTFT @{n} colocated / tfserve", ratio(c, t), "<=", 0.8))
        out.append(Target(f"TTFT @{n} all / colocated", ratio(a, c), "<=", 1.1))
    tf_tps = _get(results, "tfserve", "concurrent", "output_tok_s")
    tf_tbt = _get(results, "tfserve", "concurrent", "tbt_p50_gaps")
    tf_tbt_req = _get(results, "tfserve", "concurrent", "tbt_p50_per_request")
    for s in ("all", "colocated"):
        out.append(Target(f"concurrent output tok/s {s} / tfserve",
                          ratio(_get(results, s, "concurrent", "output_tok_s"), tf_tps),
                          ">=", 1.5))
        per_req = ratio(_get(results, s, "concurrent", "tbt_p50_per_request"), tf_tbt_req)
        out.append(Target(f"concurrent TBT p50 (all gaps) {s} / tfserve",
                          ratio(_get(results, s, "concurrent", "tbt_p50_gaps"), tf_tbt),
                          "<=", 1.0, note=f"per-request TBT p50 ratio "
                          f"{'n/a' if math.isnan(per_req) else f'{per_req:.2f}x'}"))
    cap = {s: _get(results, s, "replay", "within_slo") for s in SYSTEMS}

    def counts(s: str) -> str:
        got = _get(results, s, "replay", "within_slo_count")
        of = _get(results, s, "replay", "requests")
        return "-" if math.isnan(got) else f"{got:.0f}/{of:.0f}"

    for base, bound in (("tfserve", 1.5), ("colocated", 1.3)):
        out.append(Target(f"replay effective capacity all / {base}", ratio(cap["all"], cap[base]),
                          ">=", bound, note=f"within both SLOs: all {counts('all')}, "
                          f"{base} {counts(base)}"))
    out.append(Target("replay: all's accepted requests within both SLOs",
                      _get(results, "all", "replay", "accepted_within_slo"), ">=", 0.95,
                      unit="%"))
    return out


def _f(x: Any, spec: str = ".3f", width: int = 9) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>{width}}"
    return f"{x:>{width}{spec}}"


def print_tables(results: dict[str, Any], args: argparse.Namespace, sizes: Sequence[int],
                 load: dict[str, float] | None) -> None:
    """One table per workload, one row per system."""
    names = [s for s in args.systems if s in results]
    if "ttft" in args.workloads:
        print(f"\n1. TTFT (s): p50 of {args.ttft_reps} single requests, distinct prompts, "
              f"{args.ttft_max_tokens} output tokens")
        print(f"{'system':<11}" + "".join(f"{str(n) + ' tok':>11}" for n in sizes)
              + f"{'429':>6}{'err':>5}{'load':>6}")
        for s in names:
            t = results[s].get("ttft", {})
            print(f"{s:<11}" + "".join(_f(t.get(str(n), {}).get("ttft_p50"), width=11)
                                       for n in sizes)
                  + f"{sum(v.get('rejected', 0) for v in t.values()):>6}"
                  f"{sum(v.get('errors', 0) for v in t.values()):>5}"
                  f"{_f(_max_load(results[s], 'ttft'), '.1f', 6)}")
    if "concurrent" in args.workloads:
        print(f"\n2. {args.concurrency} concurrent requests, {args.concurrent_prompt_tokens}-token "
              f"prompts, {args.concurrent_output_tokens} output tokens")
        print(f"{'system':<11}{'ok':>4}{'429':>5}{'err':>5}{'short':>6}{'wall s':>8}"
              f"{'out tok':>8}{'tok/s':>8}{'TBT p50':>9}{'TBT p99':>9}{'req TBT p50':>12}"
              f"{'TTFT p50':>9}{'load':>6}")
        for s in names:
            c = results[s].get("concurrent")
            if not c:
                print(f"{s:<11}  (no result)")
                continue
            print(f"{s:<11}{c['ok']:>4}{c['rejected']:>5}{c['errors']:>5}{c['short']:>6}"
                  f"{_f(c['wall_s'], '.1f', 8)}{c['output_tokens']:>8}"
                  f"{_f(c['output_tok_s'], '.1f', 8)}{_f(c['tbt_p50_gaps'])}"
                  f"{_f(c['tbt_p99_gaps'])}{_f(c['tbt_p50_per_request'], '.3f', 12)}"
                  f"{_f(c['ttft_p50'])}{_f(_max_load(results[s], 'concurrent'), '.1f', 6)}")
        print("  TBT p50/p99 = over every inter-token gap; req TBT = the paper's per-request TBT "
              "(mean of its longest 10% gaps), p50 over requests")
    if "replay" in args.workloads:
        print(f"\n3. trace replay: {args.max_requests} requests, block {args.block_tokens} tokens, "
              f"outputs <= {args.max_output_tokens}, time scale {args.time_scale:g}; "
              f"SLOs TTFT {args.ttft_slo:g} s, TBT {args.tbt_slo:g} s")
        if load:
            print(f"  offered: {load['requests_s']:.2f} req/s, {load['prompt_tok_s']:.0f} prompt "
                  f"tok/s, {load['output_tok_s']:.0f} output tok/s over {load['span_s']:.0f} s")
        print(f"{'system':<11}{'ok':>4}{'429':>5}{'err':>5}{'TTFT p50':>9}{'p90':>8}"
              f"{'TBT p50':>9}{'p90':>8}{'hit':>6}{'wall s':>8}{'within SLO':>14}"
              f"{'accepted in SLO':>17}{'load':>6}")
        for s in names:
            r = results[s].get("replay")
            if not r:
                print(f"{s:<11}  (no result)")
                continue
            within = f"{r['within_slo_count']}/{r['requests']} " \
                     f"{'-' if math.isnan(r['within_slo']) else format(r['within_slo'], '.0%')}"
            acc = r["accepted_within_slo"]
            print(f"{s:<11}{r['ok']:>4}{r['rejected']:>5}{r['errors']:>5}"
                  f"{_f(r['ttft_p50'], '.2f')}{_f(r['ttft_p90'], '.2f', 8)}"
                  f"{_f(r['tbt_p50'])}{_f(r['tbt_p90'], '.3f', 8)}"
                  f"{_f(r['cache_hit_rate'], '.2f', 6)}{_f(r['wall_s'], '.0f', 8)}"
                  f"{within:>14}{'-' if math.isnan(acc) else format(acc, '.0%'):>17}"
                  f"{_f(_max_load(results[s], 'replay'), '.1f', 6)}")
    busiest = max((_max_load(results[s], w) for s in names for w in WORKLOADS
                   if not math.isnan(_max_load(results[s], w))), default=0.0)
    if busiest > (os.cpu_count() or 1) * 0.75:
        print(f"\nnote: load average up to {busiest:.1f} on {os.cpu_count()} cores while measuring"
              ": other work on the machine skews whichever system ran then (column `load`)")
    for s in names:
        for e in results[s].get("errors", []):
            print(f"{s}: {e.splitlines()[0]}")
        for w in ("ttft", "concurrent", "replay"):
            node = results[s].get(w) or {}
            firsts = [node.get("first_error")] if w != "ttft" else \
                [v.get("first_error") for v in node.values()]
            first = next((f for f in firsts if f), "")
            if first:
                print(f"{s} {w}: first failed request: {first}")


def _max_load(system: dict[str, Any], workload: str) -> float:
    return max(system.get("load_avg_1m", {}).get(workload) or [math.nan])


# ---------------------------------------------------------------------------------------------
# Main


def build_parser() -> argparse.ArgumentParser:
    """The script's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated, run in this order: all, colocated, tfserve")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated: ttft, concurrent, replay (default: all three)")
    p.add_argument("--quick", action="store_true",
                   help="a small check: TTFT at 64 tokens, 4 concurrent x 16 tokens, 10 trace "
                        "requests (explicit flags still win)")
    p.add_argument("--model", default=None,
                   help="local model folder for every system (default: the bundled "
                        "SmolLM2-135M-Instruct, converted to safetensors)")
    p.add_argument("--mooncake-args", default="", help='extra flags for both mooncake-server '
                   'systems, one string (e.g. "--dtype bfloat16")')
    p.add_argument("--all-args", default="", help="extra flags for --role all only")
    p.add_argument("--colocated-args", default="", help="extra flags for --role colocated only")
    p.add_argument("--tf-args", default="",
                   help='extra flags for transformers serve (e.g. "--dtype bfloat16")')
    p.add_argument("--ttft-sizes", default=None, help="prompt tokens (default 256,1024,4096)")
    p.add_argument("--ttft-reps", type=int, default=None, help="requests per size (default 3)")
    p.add_argument("--ttft-max-tokens", type=int, default=4,
                   help="output tokens of the TTFT requests (default 4)")
    p.add_argument("--concurrency", type=int, default=None, help="default 16")
    p.add_argument("--concurrent-prompt-tokens", type=int, default=None, help="default 128")
    p.add_argument("--concurrent-output-tokens", type=int, default=None, help="default 128")
    p.add_argument("--trace", default=str(rt.DEFAULT_TRACE), help="Mooncake trace (JSON lines)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="trace requests to replay, from the first (default 100)")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="real tokens standing for one 512-token hash-id block (default 16)")
    p.add_argument("--max-output-tokens", type=int, default=128,
                   help="cap on each trace request's output (default 128)")
        # NOTE: from a 2-core Xeon (AMX): transformers serve prefilled ~130-200 tok/s and decoded
    # ~40 tok/s at 4-16 streams, so the first 100 requests (41k prompt, 8.4k output tokens over
    # 28 s of trace) keep it ~70% busy at 16x (~90 prompt + 19 output tok/s offered) and
    # drown it below ~10x. Scale it with the machine: lower on more cores.
    p.add_argument("--time-scale", type=float, default=16.0,
                   help="multiply the trace's arrival gaps (2 = half the rate; default 16)")
    p.add_argument("--ttft-slo", type=float, default=5.0, help="seconds (default 5)")
    p.add_argument("--tbt-slo", type=float, default=0.2, help="seconds (default 0.2)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as an error (600)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds transformers serve may take to be ready (300; mooncake-server "
                        "roles: replay_trace's 300)")
    p.add_argument("--seed", type=int, default=0, help="trace prompts' seed")
    p.add_argument("--logs", default="/tmp/bench_serving_logs", help="servers' logs")
    p.add_argument("--out", default=None, help="write the raw results here (JSON)")
    return p


def resolve_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed flags with the --quick / full defaults filled in and the lists split."""
    args = build_parser().parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS] + [
        w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown system or workload: {', '.join(bad)} (systems: "
                         f"{', '.join(SYSTEMS)}; workloads: {', '.join(WORKLOADS)})")
    if args.model is None:
        from mooncake_server.model_assets import resolve_model

        args.model = str(resolve_model(None))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run every selected system in turn, print the tables and targets, write --out."""
    args = resolve_args(argv)
    info = cpu_info()
    print_cpu(info)
    prompts = Prompts(args.model)
    sizes = [int(s) for s in args.ttft_sizes.split(",") if s.strip()]
    probe = prompts.random(max(sizes), "probe")
    if not prompts.round_trips(probe):
        print("warning: word prompts do not re-tokenize exactly; transformers serve sees other "
              "tokens", file=sys.stderr)
    trace: list[rt.TraceRequest] = []
    load = None
    if "replay" in args.workloads:
        trace = rt.load_trace(args.trace, 0, args.max_requests)
        if not trace:
            raise SystemExit(f"no requests in {args.trace}")
        load = offered_load(trace, prompts, args.block_tokens, args.time_scale,
                            args.max_output_tokens)
    print(f"model {args.model}; {len(prompts.ids)} word tokens to draw prompts from; systems "
          f"{', '.join(args.systems)}; workloads {', '.join(args.workloads)}", flush=True)

    results: dict[str, Any] = {}
    log_dir = Path(args.logs)
    for name in args.systems:
        results[name] = run_system(name, args, prompts, trace, log_dir)

    print_tables(results, args, sizes, load)
    checks = targets(results, sizes)
    print("\ntargets:")
    for t in checks:
        print(t.line())
    if args.out:
        doc = {"cpu": info, "args": vars(args), "offered_load": load, "results": results,
               "targets": [{**asdict(t), "verdict": t.verdict} for t in checks]}
        Path(args.out).write_text(json.dumps(json_safe(doc), indent=2))
        print(f"\nraw results: {args.out}")


if __name__ == "__main__":
    main()
