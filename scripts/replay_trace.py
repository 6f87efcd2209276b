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
import itertools
import json
import math
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_report import Progress, write_report  # noqa: E402  (a sibling script, not a package)

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_sample.jsonl"

# ---------------------------------------------------------------------------------------------
# The trace and its prompts


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, start: int = 0, max_requests: int | None = None,
               ) -> list[TraceRequest]:
    """Lines `start .. start + max_requests` of a trace file."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            if max_requests is not None and len(out) >= max_requests:
                break
            d = json.loads(line)
            out.append(TraceRequest(float(d["timestamp"]), int(d["input_length"]),
                                    int(d["output_length"]), tuple(d.get("hash_ids", ()))))
    return out


class PromptBuilder:
    """Maps hash ids to fixed token blocks: equal hash-id prefixes give equal token prefixes."""

    def __init__(self, block_tokens: int, token_range: tuple[int, int] = (1000, 40000),
                 seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError(f"--block-tokens: must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self.lo, self.hi = token_range
        self.seed = seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        """The tokens standing for one 512-token trace block."""
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rnd = random.Random(f"{self.seed}:{hash_id}")
            tokens = [rnd.randrange(self.lo, self.hi) for _ in range(self.block_tokens)]
            self._blocks[hash_id] = tokens
        return tokens

    def length(self, req: TraceRequest) -> int:
        """Prompt tokens of `req` after scaling 512 -> block_tokens (at least 1)."""
        n_blocks = max(1, math.ceil(req.input_length / TRACE_BLOCK))
        last = min(TRACE_BLOCK, req.input_length - TRACE_BLOCK * (n_blocks - 1))
        scaled_last = max(1, round(last * self.block_tokens / TRACE_BLOCK))
        return (n_blocks - 1) * self.block_tokens + scaled_last

    def prompt(self, req: TraceRequest, index: int = 0) -> list[int]:
        """The token ids of `req` (`index` keeps requests without hash ids distinct)."""
        ids = list(req.hash_ids) or [-(index + 1)]
        tokens: list[int] = []
        for h in ids:
            tokens.extend(self.block(h))
        want = self.length(req)
        while len(tokens) < want:  # more input than hash ids cover: pad with private blocks
            tokens.extend(self.block(-(10**9) - index * 1000 - len(tokens)))
        return tokens[:want]


# ---------------------------------------------------------------------------------------------
# Statistics


@dataclass
class Outcome:
    """What happened to one request."""

    status: str  # ok | rejected | error
    arrival_s: float = 0.0
    index: int = 0  # the request's place in the replayed slice
    max_tokens: int = 0  # output tokens asked for
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since the request was sent
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    request_id: str = ""  # the server's id (its logs name the request by it)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_tbt(token_times: Sequence[float]) -> float | None:
    """Mean of the longest 10% of the gaps between tokens the decode made (at least one gap);
    None below 3 tokens: the conductor's own judgement of a request (scheduler/outcomes.py).
    The gap before the second token is the prefill -> decode hand-off, judged on its own
    (`second_token_within`), as it is for every system replayed."""
    from mooncake_server.roles.conductor.scheduler.outcomes import longest_tenth_mean

    return longest_tenth_mean([b - a for a, b in itertools.pairwise(token_times[1:])])


def second_token_within(token_times: Sequence[float], ttft_slo: float, tbt_slo: float) -> bool:
    """The second token (if any) came within TTFT + TBT SLOs of the request being sent."""
    return len(token_times) < 2 or token_times[1] <= ttft_slo + tbt_slo


@dataclass
class Summary:
    """The figures of one configuration's replay."""

    requests: int
    ok: int
    rejected: int
    errors: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    tbt_p50: float
    tbt_p90: float
    tbt_p99: float
    cache_hit_rate: float
    computed_tokens_per_request: float
    within_slo: float  # effective request capacity: share of all requests within both SLOs
    accepted_within_slo: float  # of the requests not rejected, the share within both SLOs
    prefill_seconds_per_request: float = float("nan")
    wall_s: float = 0.0


def within_slo(o: Outcome, ttft_slo: float, tbt_slo: float) -> bool:
    """Answered, first token within the TTFT SLO, second within TTFT + TBT, TBT (if it has
    one) within the TBT SLO."""
    tbt = request_tbt(o.token_times)
    return (o.status == "ok" and o.ttft_s is not None and o.ttft_s <= ttft_slo
            and second_token_within(o.token_times, ttft_slo, tbt_slo)
            and (tbt is None or tbt <= tbt_slo))


def summarize(outcomes: Sequence[Outcome], ttft_slo: float, tbt_slo: float) -> Summary:
    """Percentiles, hit rate and SLO attainment over `outcomes`."""
    ok = [o for o in outcomes if o.status == "ok"]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    tbts = [t for t in (request_tbt(o.token_times) for o in ok) if t is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    good = sum(1 for o in outcomes if within_slo(o, ttft_slo, tbt_slo))
    rejected = sum(1 for o in outcomes if o.status == "rejected")
    accepted = len(outcomes) - rejected
    return Summary(
        requests=len(outcomes), ok=len(ok), rejected=rejected,
        errors=sum(1 for o in outcomes if o.status == "error"),
        ttft_p50=percentile(ttfts, 50), ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        ttft_mean=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        tbt_p50=percentile(tbts, 50), tbt_p90=percentile(tbts, 90), tbt_p99=percentile(tbts, 99),
        cache_hit_rate=cached / prompt if prompt else float("nan"),
        computed_tokens_per_request=(prompt - cached) / len(ok) if ok else float("nan"),
        within_slo=good / len(outcomes) if outcomes else float("nan"),
        accepted_within_slo=good / accepted if accepted else float("nan"))


def request_record(config: str, o: Outcome, ttft_slo: float, tbt_slo: float) -> dict[str, object]:
    """One line of the report's requests.jsonl."""
    return {"config": config, "index": o.index, "arrival_s": round(o.arrival_s, 6),
            "status": o.status, "prompt_tokens": o.prompt_tokens,
            "output_tokens": len(o.token_times), "max_tokens": o.max_tokens,
            "cached_tokens": o.cached_tokens, "ttft_s": o.ttft_s,
            "tbt_s": request_tbt(o.token_times),
            "within_slo": within_slo(o, ttft_slo, tbt_slo), "error": o.error or None,
            "request_id": o.request_id or None}


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


@dataclass
class Launched:
    """A running configuration: its public URL and its prefill instances' URLs."""

    name: str
    url: str
    prefill_urls: list[str]
    secret: str
    pids: list[int] = field(default_factory=list)  # the processes started, to reap their trees


_SPEC = re.compile(r"^(\d+)p(\d+)d(?::([a-z-]+))?$")


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], want: dict[str, int],
                  timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a server process exited during start-up")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            counts = r.json().get("instances", {}) if r.status_code == 200 else None
            if r.status_code == 200 and all((counts or {}).get(k, 0) >= v
                                            for k, v in want.items()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:.0f} s")


@contextmanager
def launch(spec: str, server_args: list[str], conductor_args: list[str],
           log_dir: Path, prefill_args: Sequence[str] = (),
           decode_args: Sequence[str] = (), store_memory: str = "1GiB") -> Iterator[Launched]:
    """Start configuration `spec` on free ports; stop it on exit.

    `prefill_args` / `decode_args` go to those roles only (`all`: to every role; `colocated`:
    prefill_args, its engine prefills).
    """
    from mooncake_testkit.ports import free_port_block

    secret = secrets.token_hex(16)
    env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": secret}
    py = [sys.executable, "-m", "mooncake_server"]
    common = ["--kv-memory", "512MiB", *server_args]
    m = _SPEC.match(spec)
    engines = int(m.group(1)) + int(m.group(2)) if m else 2 if spec == "all" else 1
    if spec not in ("colocated", "all") and not any(a.startswith("--torch-threads")
                                                    for a in server_args):
        # Roles started one by one share no core budget board (`all` makes one, colocated is
        # alone): each engine process gets a fixed share of the cores.
        common += ["--torch-threads", str(max(1, (os.cpu_count() or 1) // engines))]
    if spec in ("colocated", "all"):
        port = free_port_block(6)
        extra = [*prefill_args] if spec == "colocated" else [*conductor_args, *decode_args]
        argvs = [[*py, "--role", spec, "--port", str(port), "--memory", store_memory, *common,
                  *extra]]
        prefill_urls = [f"http://127.0.0.1:{port + 2}"] if spec == "all" else []
        want = {"prefill": 1, "decode": 1} if spec == "all" else {}
    elif m:
        n_p, n_d, policy = int(m.group(1)), int(m.group(2)), m.group(3)
        port = free_port_block(3 + n_p + n_d)
        conductor = f"http://127.0.0.1:{port}"
        argvs = [[*py, "--role", "conductor", "--port", str(port), *server_args,
                  *conductor_args, *(["--policy", policy] if policy else [])],
                 [*py, "--role", "store", "--port", str(port + 1), "--memory", store_memory,
                  "--conductor-url", conductor, *server_args]]
        prefill_urls = []
        for i in range(n_p + n_d):
            role = "prefill" if i < n_p else "decode"
            argvs.append([*py, "--role", role, "--port", str(port + 2 + i), "--conductor-url",
                          conductor, "--instance-id", f"{role}-{i}", *common,
                          *(prefill_args if role == "prefill" else decode_args)])
            if role == "prefill":
                prefill_urls.append(f"http://127.0.0.1:{port + 2 + i}")
        want = {"prefill": n_p, "decode": n_d, "store": 1}
    else:
        raise ValueError(f"--launch: unknown configuration {spec!r} "
                         "(colocated, all, or PpDd[:policy] such as 2p1d:load)")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    with ExitStack() as logs:
        try:
            for i, argv in enumerate(argvs):
                log = logs.enter_context(open(log_dir / f"{spec.replace(':', '_')}-{i}.log", "wb"))
                procs.append(subprocess.Popen(argv, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, procs, want)
            yield Launched(spec, url, prefill_urls, secret, [p.pid for p in procs])
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)  # graceful
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


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


def _model_of(url: str, given: str | None) -> str:
    return given or str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


class ConfigRun(NamedTuple):
    """One configuration's replay: its figures and every request's outcome."""

    summary: Summary
    outcomes: list[Outcome]


def run_one(url: str, args: argparse.Namespace, trace: list[TraceRequest],
            launched: Launched | None = None, name: str = "replay") -> ConfigRun:
    """Warm up, replay, summarize."""
    model = _model_of(url, args.model)
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
    print(f"{len(trace)} requests over {(trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000:.1f}"
          f" s of trace time x {args.time_scale:g}; block {TRACE_BLOCK} -> {args.block_tokens} "
          "tokens")
    runs: dict[str, ConfigRun] = {}
    if args.launch:
        conductor_args = ["--profile", args.profile] if args.profile else []
        decode_args = []
        if args.early_reject:
            conductor_args += ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]
            # Decode admission control refuses what would break the TBT SLO.
            decode_args = ["--tbt-slo", str(args.tbt_slo)]
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
