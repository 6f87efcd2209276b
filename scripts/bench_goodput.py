#!/usr/bin/env python3
"""Goodput on bursty traffic: the share of requests served within both SLOs, per arrival rate.

  .venv/bin/python scripts/bench_goodput.py --out goodput/
  .venv/bin/python scripts/bench_goodput.py --scales 16,4 --systems all-slo,colocated
  .venv/bin/python scripts/bench_goodput.py --bound-only   # the offline bound per rate alone

The trace: the first --requests lines of traces/synthetic_trace.jsonl (the paper's synthetic
trace, shipped) with each timestamp rounded down to its 3-second bucket, as
production traces record them, so requests land in bursts; hash-id blocks become 16-token
blocks (scripts/replay_trace.py's prompts), outputs capped at 64 tokens. An arrival rate is the
trace's clock times --scales (x16 = 16 s for each trace second, the light end). For each rate
and system a fresh server is started, the burst arrivals replayed, and the server stopped
(never two at once). A request still unanswered --drain-s after the last arrival is a miss.

Systems: `all-slo` (`--role all --ttft-slo/--tbt-slo`), `colocated-slo` (`--role colocated`
with the same flags), `colocated` (no SLO flags), `tfserve` (`transformers serve
--continuous-batching`). Printed per point: share of ALL
requests within SLO (a 429 is a miss), share of ACCEPTED within SLO, rejections, and for
all-slo the conductor's measured / estimated TTFT p50 / p90 (its /metrics); per system its
goodput (the slowest-to-fastest scan's highest rate with >= 90% of all requests within SLO).
Also per rate a bound: the most requests any admission could serve within both SLOs on the
same arrivals, by an offline schedule (mooncake_bench/goodput_bound.py) over costs measured on
an idle all-slo server of its own, started before the points: prefill per prompt length (lone
prompts of 128-2,048 tokens) and decode steps per batch size, with every assumption in the
server's favour; "of bound" is a point's share of it.
SLO: TTFT 5 s, TBT 200 ms (TBT over the decode's gaps; the hand-off before the second token is
held to TTFT + TBT, for every system alike). Writes goodput.json, goodput.png and one
requests-<system>-x<scale>.jsonl per point (each request's outcome) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import shlex
import statistics
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_bench import client as bs  # noqa: E402  (the checkout's package, installed or not)
from mooncake_bench import goodput_bound as gb  # noqa: E402
from mooncake_bench import machine, systems  # noqa: E402
from mooncake_bench import trace as rt  # noqa: E402
from mooncake_bench.report import line_chart  # noqa: E402

BUCKET_MS = 3000.0
SYSTEMS = ("all-slo", "colocated-slo", "colocated", "tfserve")
GOODPUT_SHARE = 0.9
MAX_OUTPUT = 64
PREFILL_SAMPLES = (128, 512, 1024, 2048)
DECODE_SAMPLES = (1, 8)


def bursty_trace(path: Path, requests: int) -> list[rt.TraceRequest]:
    """The first `requests` lines, each timestamp rounded down to its 3-second bucket."""
    return [dataclasses.replace(r, timestamp_ms=r.timestamp_ms // BUCKET_MS * BUCKET_MS)
            for r in rt.load_trace(path, 0, requests)]


async def replay_point(api: bs.Api, prompts: bs.Prompts, trace: list[rt.TraceRequest],
                       scale: float, max_output: int, drain_s: float) -> list[bs.Result]:
    """Each request at its scaled burst time; unanswered ones `drain_s` after the last arrival
    end as misses (status "timeout")."""
    builder = prompts.builder(16, 0)
    t0 = trace[0].timestamp_ms
    end = (trace[-1].timestamp_ms - t0) / 1000.0 * scale + drain_s
    async with bs.new_client(end + 60) as client:
        begin = time.perf_counter()

        async def one(i: int, req: rt.TraceRequest) -> bs.Result:
            at = (req.timestamp_ms - t0) / 1000.0 * scale
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            n_out = max(1, min(req.output_length, max_output))
            left = begin + end - time.perf_counter()
            try:
                r = await asyncio.wait_for(
                    bs.send(client, api, prompts.trace_prompt(builder, req, i), n_out), left)
            except TimeoutError:
                r = bs.Result("timeout", error=f"unanswered {drain_s:g} s after the last arrival")
            r.arrival_s, r.max_tokens = at, n_out
            return r

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(trace))))


def estimate_ratios(url: str) -> dict[str, float]:
    """The conductor's measured / estimated TTFT and TBT quantiles (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        key = family.name.removeprefix("mooncake_scheduler_")
        if key != family.name and key.endswith("_measured_over_estimated"):
            for sample in family.samples:
                q = round(float(sample.labels["quantile"]) * 100)
                out[f"{key.split('_')[0]}_ratio_p{q}"] = sample.value
    return out


def idle_costs(api: bs.Api, prompts: bs.Prompts) -> gb.Costs | None:
    """The bound's costs, measured on the idle server: lone prompts of 128-2,048 tokens (the
    best of two each: time to first token) and decode steps of 1 and 8 rows (median gap)."""
    async def measure() -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        async with bs.new_client(120) as client:
            prefill = []
            for n in PREFILL_SAMPLES:
                best = min([(await bs.send(client, api, prompts.random(n, f"idle{n}-{i}"), 1))
                            .ttft_s or float("inf") for i in range(2)])
                prefill.append((n, best))
            decode = []
            for rows in DECODE_SAMPLES:
                got = await asyncio.gather(*(bs.send(client, api, prompts.random(32, f"d{rows}-{i}"),
                                                     64) for i in range(rows)))
                gaps = [b - a for r in got for a, b in itertools.pairwise(r.token_times[2:])]
                if gaps:  # refused or failed, a batch has no gaps: the bound is not drawn
                    decode.append((rows, statistics.median(gaps)))
            return prefill, decode
    prefill, decode = asyncio.run(measure())
    # A prompt refused or failed has no time (inf): fit the ones that answered.
    prefill = [(n, t) for n, t in prefill if math.isfinite(t)]
    if len(prefill) < 2 or len(decode) < 2:
        print(f"  no bound: the idle server answered {len(prefill)} of its prompts and streamed "
              f"{len(decode)} of its decode batches", flush=True)
        return None
    return gb.Costs(*gb.fit_prefill(prefill), *gb.fit_decode(decode))


def burst_work(trace: list[rt.TraceRequest], builder: rt.PromptBuilder, scale: float,
               max_output: int) -> dict[float, list[gb.Request]]:
    """Each burst's arrival (scaled seconds) -> its requests (uncached prompt tokens: hash-id
    blocks seen in an earlier request count as cached; output tokens)."""
    seen: set[int] = set()
    t0 = trace[0].timestamp_ms
    bursts: dict[float, list[gb.Request]] = {}
    for r in trace:
        n = builder.length(r)
        cached = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            cached += 16
        seen.update(r.hash_ids)
        arrive = (r.timestamp_ms - t0) / 1000.0 * scale
        bursts.setdefault(arrive, []).append(
            gb.Request(max(1, n - min(cached, n - 1)), max(1, min(r.output_length, max_output))))
    return bursts


def launch(system: str, args: argparse.Namespace,
           log_dir: Path) -> AbstractContextManager[bs.Api]:
    """Start `system` (stopped with its whole process tree on exit)."""
    if system in ("tfserve", "all-slo"):
        return systems.launch_system(system.removesuffix("-slo"), args, log_dir,
                                     system == "all-slo")
    slo = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]
    server_args = ["--model", args.model, *shlex.split(args.mooncake_args),
                   *shlex.split(args.colocated_args), *(slo if system == "colocated-slo" else [])]
    return systems.start_mooncake("colocated", server_args, [], log_dir)


def run_point(system: str, scale: float, args: argparse.Namespace, prompts: bs.Prompts,
              trace: list[rt.TraceRequest], log_dir: Path) -> dict:
    """One fresh server, one replay: its figures."""
    t0 = time.perf_counter()
    with launch(system, args, log_dir / f"{system}-x{scale:g}") as api:
        api.prompts = prompts
        asyncio.run(bs.warm_up(api, prompts, 128, args.request_timeout))
        # The trace starts on an idle cluster: two heartbeats (1 s apart by default) so that
        # no load report from the warm-up still counts (a prefill's last one said a job was
        # waiting, and the first burst was judged in cut passes: its 564- and 583-token
        # prompts were refused at an estimated 5.7 s).
        time.sleep(2.5)
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        results = asyncio.run(replay_point(api, prompts, trace, scale, MAX_OUTPUT,
                                           args.drain_s))
        wall = time.perf_counter() - t1
        ratios = estimate_ratios(api.url) if system == "all-slo" else {}
    with open(Path(args.out) / f"requests-{system}-x{scale:g}.jsonl", "w") as f:
        for i, r in enumerate(results):
            r.index = i
            record = rt.request_record(system, r, args.ttft_slo, args.tbt_slo)
            record["second_token_s"] = r.token_times[1] if len(r.token_times) > 1 else None
            f.write(json.dumps(record) + "\n")
    s = rt.summarize(results, args.ttft_slo, args.tbt_slo)
    timeouts = sum(1 for r in results if r.status == "timeout")
    return {"system": system, "scale": scale, "requests": s.requests,
            "within_slo": s.within_slo, "accepted_within_slo": s.accepted_within_slo,
            "rejected": s.rejected, "timeouts": timeouts, "errors": s.errors - timeouts,
            "ttft_p50": s.ttft_p50, "ttft_p90": s.ttft_p90, "tbt_p90": s.tbt_p90,
            "wall_s": wall, "startup_s": started, **ratios}


def plot(points: list[dict], bounds: dict[float, float], path: Path) -> None:
    """Share of all requests within SLO vs arrival rate, one line per system (Fig. 14 style)."""
    lines = {system: [(p["rate"], p["within_slo"]) for p in points if p["system"] == system]
             for system in SYSTEMS}
    line_chart(path, lines, "arrival rate (requests/s)", "share of all requests within SLO",
               hline=GOODPUT_SHARE, dashed={"offline bound": list(bounds.items())})


def main() -> None:
    """Every (system, rate) point; the table, goodput per system, JSON and PNG."""
    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--trace", default=str(rt.SYNTHETIC_TRACE))
        p.add_argument("--requests", type=int, default=60)
        p.add_argument("--scales", default="16,4,2", help="trace clock multipliers")
        p.add_argument("--systems", default=",".join(SYSTEMS))
        p.add_argument("--ttft-slo", type=float, default=5.0)
        p.add_argument("--tbt-slo", type=float, default=0.2)
        p.add_argument("--drain-s", type=float, default=40.0)
        p.add_argument("--request-timeout", type=float, default=600.0)
        p.add_argument("--startup-timeout", type=float, default=300.0)
        p.add_argument("--mooncake-args", default="")
        p.add_argument("--all-args", default="")
        p.add_argument("--colocated-args", default="")
        p.add_argument("--tf-args", default="")
        p.add_argument("--out", default="goodput")
        p.add_argument("--bound-only", action="store_true",
                       help="measure the idle costs on an all-slo server, print the bounds, stop")

    args, args.model, prompts = machine.one_server_bench(__doc__.splitlines()[0], "goodput-logs",
                                                    flags)
    trace = bursty_trace(Path(args.trace), args.requests)
    # The trace's duration counts its last bucket whole: 6 buckets of 3 s are 18 s.
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms + BUCKET_MS) / 1000.0
    bursts = len({r.timestamp_ms for r in trace})
    print(f"trace: {len(trace)} requests of {args.trace} in {bursts} bursts over {span:g} "
          "trace seconds", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scales = [float(x) for x in args.scales.split(",")]
    points: list[dict] = []
    costs: gb.Costs | None = None
    # NOTE: on a server of its own: measured on the first replay's server, its prompts (eight
    # 32-token ones answered at 1.88x their estimates in a host stall) went into that replay's
    # measured / estimated TTFT and put its p90 at 1.90.
    if args.bound_only or "all-slo" in args.systems.split(","):
        with launch("all-slo", args, Path(args.logs) / "bound") as api:
            api.prompts = prompts
            asyncio.run(bs.warm_up(api, prompts, 128, args.request_timeout))
            costs = idle_costs(api, prompts)
    for scale in [] if args.bound_only else scales:
        for system in args.systems.split(","):
            print(f"{system} at x{scale:g} ...", flush=True)
            try:
                p = run_point(system, scale, args, prompts, trace, Path(args.logs))
            except Exception as exc:  # noqa: BLE001 - one broken point must not lose the rest
                print(f"  failed: {exc}", file=sys.stderr, flush=True)
                continue
            p["rate"] = len(trace) / (span * scale)
            points.append(p)
            print(f"  within SLO {p['within_slo']:.0%} of all, {p['accepted_within_slo']:.0%} "
                  f"of accepted; rejected {p['rejected']}, unanswered {p['timeouts']}", flush=True)
    builder = prompts.builder(16, 0)
    bounds = {len(trace) / (span * s): gb.best_served(
        burst_work(trace, builder, s, MAX_OUTPUT), costs, args.ttft_slo, args.tbt_slo) / len(trace)
        for s in scales} if costs else {}
    print(f"\nSLOs: TTFT {args.ttft_slo:g} s, TBT {args.tbt_slo:g} s")
    if costs:
        print(f"idle costs: prefill {costs.pass_s * 1000:.0f} ms a pass + "
              f"{costs.token_s * 1000:.3f} ms/token + {costs.pair_s * 1e6:.4f} us/token^2; "
              f"decode step {costs.step_s * 1000:.1f} ms + {costs.row_s * 1000:.2f} ms/row")
        print("offline bound: " + ", ".join(f"x{s:g} ({rate:.2f} req/s) {b:.0%}"
                                            for s, (rate, b) in zip(scales, bounds.items())))
    print(f"{'system':<10}{'scale':>6}{'req/s':>7}{'all%':>6}{'acc%':>6}{'429':>5}{'late':>5}"
          f"{'TTFT p90':>9}{'TBT p90':>8}{'ttft m/e p50':>13}{'p90':>6}{'bound%':>7}"
          f"{'of bound':>9}")
    for p in points:
        b = bounds.get(p["rate"], float("nan"))
        print(f"{p['system']:<10}{p['scale']:>6g}{p['rate']:>7.2f}{p['within_slo']:>6.0%}"
              f"{p['accepted_within_slo']:>6.0%}{p['rejected']:>5}{p['timeouts']:>5}"
              f"{p['ttft_p90']:>9.2f}{p['tbt_p90']:>8.3f}"
              f"{p.get('ttft_ratio_p50', float('nan')):>13.2f}"
              f"{p.get('ttft_ratio_p90', float('nan')):>6.2f}"
              f"{b:>7.0%}{p['within_slo'] / b if b else float('nan'):>9.0%}")
    goodput = {}
    for system in {p["system"] for p in points}:
        ok = [p["rate"] for p in points if p["system"] == system
              and p["within_slo"] >= GOODPUT_SHARE]
        goodput[system] = max(ok) if ok else 0.0
        print(f"goodput {system}: {goodput[system]:.3f} req/s (highest rate with >= 90% within)")
    (out / "goodput.json").write_text(json.dumps(
        {"cpu": machine.cpu_info(), "trace": args.trace, "requests": len(trace),
         "bucket_ms": BUCKET_MS, "points": points, "bounds": bounds, "goodput": goodput,
         "costs": dataclasses.asdict(costs) if costs else None}, indent=1))
    if points:
        plot(points, bounds, out / "goodput.png")
    print(f"wrote {out / 'goodput.json'}{' and goodput.png' if points else ''} to {out}")


if __name__ == "__main__":
    main()
