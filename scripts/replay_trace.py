#!/usr/bin/env python3
"""Replay a Mooncake trace against OpenAI-compatible endpoints and compare them in one run.

  .venv/bin/python scripts/replay_trace.py --launch colocated,1p1d --max-requests 40 \\
      --time-scale 8 --block-tokens 16 --ttft-slo 5 --tbt-slo 0.3
  .venv/bin/python scripts/replay_trace.py --url http://127.0.0.1:8000 --max-requests 100

Each trace line (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token blocks)
becomes a /v1/completions request with a token-id prompt: hash id h maps to `--block-tokens` fixed
tokens, so requests sharing hash-id prefixes share exactly that token prefix, and the last block is
cut to the scaled input length. Each asks for `output_length` tokens with `ignore_eos`, streamed.
Arrivals keep the trace's gaps times `--time-scale`. Reported per configuration: TTFT and TBT
p50/p90/p99 (a request's TBT = mean of its longest 10% gaps between decode-made tokens, as the
paper; the gap before the second token is the hand-off, held to TTFT + TBT), cache hit
rate (usage.prompt_tokens_details.cached_tokens), prompt tokens computed and prefill seconds per
request (scraped from launched prefill instances), rejections (429), errors, and effective request
capacity: the share of requests answered within both SLOs. `--launch` starts each configuration
on free ports (`colocated`, `all`, or `PpDd[:policy]` = P prefill + D decode + 1 store +
conductor), replays the same slice against it, stops it, and prints ratios to the first one.
While it replays, stderr shows requests sent / done / rejected. It then writes a report folder
(`--report`, default replay-report/<timestamp>): requests.jsonl (one line per request),
summary.json (the figures above per configuration) and cdf.png (TTFT and TBT CDFs, SLOs drawn,
effective capacity per configuration; needs matplotlib, the `test` extra).
The default trace is the sample shipped in traces/ (the first 300 requests of the paper's trace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_bench.report import Progress, write_report  # noqa: E402
from mooncake_bench.systems import Launched, launch, model_of  # noqa: E402
from mooncake_bench.trace import (  # noqa: E402
    DEFAULT_TRACE,
    TRACE_BLOCK,
    Outcome,
    PromptBuilder,
    Summary,
    TraceRequest,
    load_trace,
    request_record,
    summarize,
)

# ---------------------------------------------------------------------------------------------
# The client


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
               max_tokens: int) -> Outcome:
    """One streamed completion; token arrival times relative to sending it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome("ok", prompt_tokens=len(prompt))
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                return Outcome("rejected", prompt_tokens=len(prompt))
            if r.status_code != 200:
                await r.aread()
                return Outcome("error", error=f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return Outcome("error", error=str(chunk["error"])[:200])
                out.request_id = out.request_id or chunk.get("id") or ""
                if chunk.get("choices"):
                    out.token_times.append(time.perf_counter() - start)
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", len(prompt))
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
    except httpx.HTTPError as exc:
        return Outcome("error", error=repr(exc)[:200])
    out.ttft_s = out.token_times[0] if out.token_times else None
    return out


async def replay(url: str, model: str, trace: Sequence[TraceRequest], builder: PromptBuilder,
                 time_scale: float, max_output: int | None,
                 progress: Progress | None = None) -> list[Outcome]:
    """Send every request at its (scaled) arrival time; wait for all."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    t0 = trace[0].timestamp_ms if trace else 0.0
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10), limits=limits) as client:
        begin = time.perf_counter()

        async def one(i: int, req: TraceRequest) -> Outcome:
            at = (req.timestamp_ms - t0) / 1000.0 * time_scale
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            out_len = max(1, min(req.output_length, max_output or req.output_length))
            prompt = builder.prompt(req, i)
            if progress:
                progress.on_sent()
            o = await send(client, url, model, prompt, out_len)
            o.arrival_s, o.index, o.max_tokens = at, i, out_len
            o.prompt_tokens = o.prompt_tokens or len(prompt)
            if progress:
                progress.on_done(o.status)
            return o

        async def refresh() -> None:
            # Events alone would leave the elapsed time still while long requests run.
            while True:
                await asyncio.sleep(1.0)
                if progress:
                    progress.tick()

        ticker = asyncio.create_task(refresh())
        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(trace))))
        finally:
            ticker.cancel()
            if progress:
                progress.finish()


# ---------------------------------------------------------------------------------------------
# Launching configurations


def prefill_seconds(urls: Sequence[str], secret: str) -> float | None:
    """Total `mooncake_prefill_seconds_sum` over prefill instances (None if none answers)."""
    from mooncake_server.wire.auth import secret_headers

    total, seen = 0.0, False
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", headers=secret_headers(secret), timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith("mooncake_prefill_seconds_sum"):
                total += float(line.split()[-1])
                seen = True
    return total if seen else None


# ---------------------------------------------------------------------------------------------
# Main


class ConfigRun(NamedTuple):
    """One configuration's replay: its figures and every request's outcome."""

    summary: Summary
    outcomes: list[Outcome]


def run_one(url: str, args: argparse.Namespace, trace: list[TraceRequest],
            launched: Launched | None = None, name: str = "replay") -> ConfigRun:
    """Warm up, replay, summarize."""
    model = model_of(url, args.model)
    builder = PromptBuilder(args.block_tokens, tuple(args.token_range), args.seed)
    warm = PromptBuilder(args.block_tokens, tuple(args.token_range), args.seed + 1)
    asyncio.run(replay(url, model, trace[:1], warm, 0.0, 2))  # warm-up, unrelated prefix
    before = prefill_seconds(launched.prefill_urls, launched.secret) if launched else None
    start = time.perf_counter()
    outcomes = asyncio.run(replay(url, model, trace, builder, args.time_scale,
                                  args.max_output_tokens, Progress(name, len(trace))))
    summary = summarize(outcomes, args.ttft_slo, args.tbt_slo)
    summary.wall_s = time.perf_counter() - start
    after = prefill_seconds(launched.prefill_urls, launched.secret) if launched else None
    if before is not None and after is not None and summary.ok:
        summary.prefill_seconds_per_request = (after - before) / summary.ok
    errors = [o.error for o in outcomes if o.status == "error"]
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    return ConfigRun(summary, outcomes)


def print_table(results: dict[str, Summary], ttft_slo: float, tbt_slo: float) -> None:
    """One row per configuration, then ratios against the first."""
    print(f"\nSLOs: TTFT {ttft_slo:g} s, TBT {tbt_slo:g} s")
    head = (f"{'config':<18}{'ok':>5}{'429':>5}{'err':>5}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
            f"{'mean':>8}{'TBT p50':>9}{'p90':>8}{'p99':>8}{'hit':>6}{'tok/req':>9}"
            f"{'pf s/req':>9}{'in SLO':>8}{'acc. in SLO':>12}")
    print(head)
    for name, s in results.items():
        print(f"{name:<18}{s.ok:>5}{s.rejected:>5}{s.errors:>5}{s.ttft_p50:>10.3f}"
              f"{s.ttft_p90:>8.3f}{s.ttft_p99:>8.3f}{s.ttft_mean:>8.3f}{s.tbt_p50:>9.3f}"
              f"{s.tbt_p90:>8.3f}{s.tbt_p99:>8.3f}{s.cache_hit_rate:>6.2f}"
              f"{s.computed_tokens_per_request:>9.1f}{s.prefill_seconds_per_request:>9.3f}"
              f"{s.within_slo:>8.0%}{s.accepted_within_slo:>12.0%}")
    names = list(results)
    base = results[names[0]]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"

    for name in names[1:]:
        s = results[name]
        print(f"{name} vs {names[0]}: effective capacity {ratio(s.within_slo, base.within_slo)}, "
              f"mean TTFT {ratio(s.ttft_mean, base.ttft_mean)}, TBT p90 "
              f"{ratio(s.tbt_p90, base.tbt_p90)}, prompt tokens computed per request "
              f"{ratio(s.computed_tokens_per_request, base.computed_tokens_per_request)}")


def build_parser() -> argparse.ArgumentParser:
    """The script's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (JSON lines)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="replay against this OpenAI-compatible base URL")
    where.add_argument("--launch", default=None,
                       help="comma-separated configurations to start and compare: colocated, "
                            "all, PpDd[:policy] (e.g. colocated,1p1d or 2p1d:load,"
                            "2p1d:cache-global)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="real tokens standing for one 512-token trace block (default 16)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the trace's arrival times (2 = half the rate; default 1)")
    p.add_argument("--start", type=int, default=0, help="first trace line to replay")
    p.add_argument("--max-requests", type=int, default=100, help="requests to replay")
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap each request's output_length (default: the trace's)")
    p.add_argument("--ttft-slo", type=float, default=5.0, help="seconds (default 5)")
    p.add_argument("--tbt-slo", type=float, default=0.3, help="seconds (default 0.3)")
    p.add_argument("--early-reject", action="store_true",
                   help="give launched conductors the SLOs (--ttft-slo/--tbt-slo: 429 early)")
    p.add_argument("--profile", default=None, help="cost model file for launched conductors")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every launched server process (repeat; e.g. "
                        "--server-arg=--torch-threads=1)")
    p.add_argument("--decode-arg", action="append", default=[],
                   help="extra flag for launched decode instances only (repeat; e.g. "
                        "--decode-arg=--kv-memory=4GiB so no request waits for KV memory)")
    p.add_argument("--prefill-arg", action="append", default=[],
                   help="extra flag for launched prefill instances only (repeat; e.g. "
                        "--prefill-arg=--kv-memory=256MiB for small local prefix caches)")
    p.add_argument("--store-memory", default="1GiB", help="launched store's DRAM pool")
    p.add_argument("--token-range", type=int, nargs=2, default=[1000, 40000],
                   metavar=("LO", "HI"), help="token ids to draw prompts from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default="/tmp/replay_trace_logs", help="launched servers' logs")
    p.add_argument("--json", default=None, help="also write the summaries here")
    p.add_argument("--report", default=None,
                   help="report folder: requests.jsonl, summary.json, cdf.png (default "
                        "replay-report/<timestamp>)")
    p.add_argument("--no-report", action="store_true", help="print the table only")
    return p


def report_folder(given: str | None, now: float | None = None) -> Path:
    """--report, or replay-report/<local timestamp> so runs never overwrite each other."""
    if given:
        return Path(given)
    return Path("replay-report") / time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def main(argv: Sequence[str] | None = None) -> None:
    """Replay against --url, or launch and compare each --launch configuration."""
    args = build_parser().parse_args(argv)
    trace = load_trace(args.trace, args.start, args.max_requests)
    if not trace:
        raise SystemExit("no requests in the selected trace slice")
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000
    print(f"{len(trace)} requests over {span_s:.1f}"
          f" s of trace time x {args.time_scale:g}; block {TRACE_BLOCK} -> {args.block_tokens} "
          "tokens")
    runs: dict[str, ConfigRun] = {}
    if args.launch:
        conductor_args = ["--profile", args.profile] if args.profile else []
        decode_args = list(args.decode_arg)
        if args.early_reject:
            conductor_args += ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]
            # Decode admission control refuses what would break the TBT SLO.
            decode_args += ["--tbt-slo", str(args.tbt_slo)]
        for spec in [s.strip() for s in args.launch.split(",") if s.strip()]:
            print(f"launching {spec} ...", flush=True)
            with launch(spec, args.server_arg, conductor_args, Path(args.logs),
                        args.prefill_arg, decode_args, args.store_memory) as cluster:
                runs[spec] = run_one(cluster.url, args, trace, cluster, spec)
            print(f"  {spec}: done in {runs[spec].summary.wall_s:.0f} s", flush=True)
    else:
        url = (args.url or "http://127.0.0.1:8000").rstrip("/")
        runs[url] = run_one(url, args, trace, name=url)
    results = {name: run.summary for name, run in runs.items()}
    print_table(results, args.ttft_slo, args.tbt_slo)
    if args.json:
        Path(args.json).write_text(json.dumps({k: asdict(v) for k, v in results.items()},
                                              indent=2))
    if not args.no_report:
        records = [request_record(name, o, args.ttft_slo, args.tbt_slo)
                   for name, run in runs.items() for o in run.outcomes]
        meta = {"trace": str(args.trace), "start": args.start, "requests": len(trace),
                "time_scale": args.time_scale, "block_tokens": args.block_tokens,
                "max_output_tokens": args.max_output_tokens, "early_reject": args.early_reject,
                "seed": args.seed}
        folder = write_report(report_folder(args.report), records,
                              {k: asdict(v) for k, v in results.items()}, meta,
                              args.ttft_slo, args.tbt_slo)
        print(f"\nreport: {folder}/ (requests.jsonl, summary.json, cdf.png)")


if __name__ == "__main__":
    main()
