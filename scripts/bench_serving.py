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
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay_trace as rt  # a sibling script, not a package

SYSTEMS = ("all", "colocated", "tfserve")
WORKLOADS = ("ttft", "concurrent", "replay")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")

# Full run, and what --quick shrinks it to (explicit flags win over both).
FULL = {"ttft_sizes": "256,1024,4096", "ttft_reps": 3, "concurrency": 16,
        "concurrent_prompt_tokens": 128, "concurrent_output_tokens": 128, "max_requests": 100}
QUICK = {"ttft_sizes": "64", "ttft_reps": 3, "concurrency": 4, "concurrent_prompt_tokens": 64,
         "concurrent_output_tokens": 16, "max_requests": 10}

# ---------------------------------------------------------------------------------------------
# The machine


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """CPU model, core count and the SIMD / matrix flags that decide CPU inference speed."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), "unknown")
    flags_line = next((line.split(":", 1)[1] for line in cpuinfo.splitlines()
                       if line.startswith("flags")), "")
    present = set(flags_line.split())
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {"model": model, "cores": os.cpu_count(), "load_avg": load,
            "flags": {f: f in present for f in CPU_FLAGS}}


def print_cpu(info: dict[str, Any]) -> None:
    """One header line about the CPU (a shared machine shows in its load average)."""
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in info["flags"].items())
    load = " ".join(f"{x:.2f}" for x in info["load_avg"])
    print(f"CPU: {info['model']}, {info['cores']} cores; {flags}; load average {load}")


# ---------------------------------------------------------------------------------------------
# Prompts


def one_server_bench(description: str, logs: str,
                     add_flags: Callable[[argparse.ArgumentParser], None],
                     ) -> tuple[argparse.Namespace, str, Prompts]:
    """A one-server benchmark's start: its flags (plus --model, --logs), the model resolved,
    the CPU printed, and the prompt maker."""
    from mooncake_server.model_assets import resolve_model

    p = argparse.ArgumentParser(description=description)
    add_flags(p)
    p.add_argument("--model", default=None)
    p.add_argument("--logs", default=logs)
    args = p.parse_args()
    model = str(resolve_model(args.model))
    print_cpu(cpu_info())
    return args, model, Prompts(model)


def word_token_ids(tokenizer: Any, lo: int = 1000) -> list[int]:
    """Ids (>= lo) of tokens that are one space-led ASCII word and encode back to themselves."""
    ids = []
    for piece, i in tokenizer.get_vocab().items():
        # "Ġ" is the byte-level space: the pre-tokenizer splits text before each such word, so
        # a sequence of them re-tokenizes token by token.
        if i >= lo and re.fullmatch(r"\u0120[A-Za-z]+", piece) \
                and tokenizer.encode(tokenizer.decode([i])).ids == [i]:
            ids.append(i)
    return sorted(ids)


class Prompts:
    """Random prompts of word tokens, as ids and as the text that tokenizes to those ids."""

    def __init__(self, model_path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        self.ids = word_token_ids(self.tokenizer)
        if len(self.ids) < 1000:
            raise RuntimeError(f"only {len(self.ids)} single-token words in {model_path}'s "
                               "vocabulary: cannot build round-tripping prompts")

    def random(self, n: int, seed: int | str) -> list[int]:
        """`n` token ids, the same for the same seed."""
        rnd = random.Random(f"bench_serving:{seed}")
        return [self.ids[rnd.randrange(len(self.ids))] for _ in range(n)]

    def builder(self, block_tokens: int, seed: int) -> rt.PromptBuilder:
        """replay_trace's hash-id prompts, drawing indices into the word vocabulary."""
        return rt.PromptBuilder(block_tokens, (0, len(self.ids)), seed)

    def trace_prompt(self, builder: rt.PromptBuilder, req: rt.TraceRequest,
                     index: int) -> list[int]:
        """The word-token prompt of one trace request (shared hash-id prefixes stay shared)."""
        return [self.ids[i] for i in builder.prompt(req, index)]

    def text(self, ids: Sequence[int]) -> str:
        """The text of `ids`."""
        return self.tokenizer.decode(list(ids))

    def round_trips(self, ids: Sequence[int]) -> bool:
        """Whether the text of `ids` tokenizes back to exactly `ids`."""
        return self.tokenizer.encode(self.text(ids), add_special_tokens=True).ids == list(ids)


# ---------------------------------------------------------------------------------------------
# The client


@dataclass
class Api:
    """Where and how to send completions to one system."""

    kind: str  # mooncake | tfserve
    url: str
    model: str
    prompts: Prompts | None = None  # tfserve: turns ids into text


def completion_body(api: Api, prompt: Sequence[int], max_tokens: int,
                    sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The streamed, exactly-`max_tokens` /v1/completions body for `api`'s server.

    Greedy unless `sampling` gives other fields (temperature, top_p, seed).
    """
    body: dict[str, Any] = {"model": api.model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, **(sampling or {})}
    if api.kind == "tfserve":
        assert api.prompts is not None
        body["prompt"] = api.prompts.text(prompt)
        # It parses this field with json.loads (a dict is a 500), and 422s `ignore_eos`; an
        # eos id no token has is its way to never stop early.
        body["generation_config"] = json.dumps({"max_new_tokens": max_tokens,
                                                "eos_token_id": -1})
    else:
        body["prompt"] = list(prompt)
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Result(rt.Outcome):
    """replay_trace's Outcome plus what the throughput figures need."""

    requested_tokens: int = 0
    completion_tokens: int = 0  # usage.completion_tokens, else the token chunks seen
    finished: bool = False  # a finish_reason arrived


def parse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON of one SSE `data:` line (None for other lines and [DONE])."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data.startswith("{"):
        return None
    return json.loads(data)


async def send(client: httpx.AsyncClient, api: Api, prompt: Sequence[int],
               max_tokens: int, sampling: dict[str, Any] | None = None) -> Result:
    """One streamed completion; never raises (HTTP 429 = rejected, anything else wrong = error)."""
    out = Result("ok", prompt_tokens=len(prompt), requested_tokens=max_tokens)
    first_chunk: float | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{api.url}/v1/completions",
                                 json=completion_body(api, prompt, max_tokens, sampling)) as r:
            if r.status_code != 200:
                await r.aread()
                out.status = "rejected" if r.status_code == 429 else "error"
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            async for line in r.aiter_lines():
                chunk = parse_chunk(line)
                if chunk is None:
                    continue
                now = time.perf_counter() - start
                if chunk.get("error"):
                    out.status, out.error = "error", str(chunk["error"])[:200]
                    return out
                choices = chunk.get("choices") or []
                if choices and first_chunk is None:
                    first_chunk = now
                # A token is an event the user sees: text. Finish / usage-only chunks are not
                # tokens (transformers serve sends an empty one after the last token).
                if any(c.get("text") for c in choices):
                    out.token_times.append(now)
                if any(c.get("finish_reason") for c in choices):
                    out.finished = True
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens") or len(prompt)
                    out.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, ValueError) as exc:
        out.status, out.error = "error", repr(exc)[:200]
        return out
    if not out.finished:
        out.status, out.error = "error", "stream ended without a finish_reason"
        return out
    if not out.token_times and first_chunk is not None:
        out.token_times.append(first_chunk)  # the only token's text was empty
    out.ttft_s = out.token_times[0] if out.token_times else None
    out.completion_tokens = out.completion_tokens or len(out.token_times)
    return out


def new_client(timeout_s: float) -> httpx.AsyncClient:
    """An HTTP client for many concurrent streams, each bounded by `timeout_s`."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits)


# ---------------------------------------------------------------------------------------------
# Workloads


def errors_of(results: Sequence[Result]) -> dict[str, Any]:
    """Counts of rejected / failed / short requests and the first error text."""
    errs = [r.error for r in results if r.status != "ok"]
    return {"rejected": sum(r.status == "rejected" for r in results),
            "errors": sum(r.status == "error" for r in results),
            "short": sum(r.status == "ok" and r.completion_tokens < r.requested_tokens
                         for r in results),
            "first_error": errs[0] if errs else ""}


async def warm_up(api: Api, prompts: Prompts, prompt_tokens: int, timeout_s: float) -> None:
    """Requests no measurement shares a prefix with: first-request set-up (CB init, allocators)."""
    async with new_client(timeout_s) as client:
        for n in sorted({16, prompt_tokens}):
            r = await send(client, api, prompts.random(n, f"warm:{n}"), 4)
            if r.status != "ok":
                print(f"  warm-up ({n} tokens) failed: {r.error}", file=sys.stderr)


async def ttft_workload(api: Api, prompts: Prompts, sizes: Sequence[int], reps: int,
                        max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """Per prompt size: p50 TTFT of `reps` requests sent one at a time, distinct prompts."""
    out: dict[str, Any] = {}
    async with new_client(timeout_s) as client:
        for n in sizes:
            results = [await send(client, api, prompts.random(n, f"ttft:{n}:{i}"), max_tokens)
                       for i in range(reps)]
            ttfts = [r.ttft_s for r in results if r.status == "ok" and r.ttft_s is not None]
            out[str(n)] = {"ttft_p50": rt.percentile(ttfts, 50), "ttfts": ttfts,
                           "prompt_tokens_seen": [r.prompt_tokens for r in results],
                           **errors_of(results)}
    return out


def concurrent_summary(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    """Output tok/s, TBT p50 over all gaps and over requests (paper TBT), TTFT p50."""
    ok = [r for r in results if r.status == "ok"]
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    per_request = [t for t in (rt.request_tbt(r.token_times) for r in ok) if t is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {"requests": len(results), "ok": len(ok), "wall_s": wall_s,
            "output_tokens": tokens,
            "output_tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
            "tbt_p50_gaps": rt.percentile(gaps, 50), "tbt_p99_gaps": rt.percentile(gaps, 99),
            "tbt_p50_per_request": rt.percentile(per_request, 50),
            "ttft_p50": rt.percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
            **errors_of(results)}


async def concurrent_workload(api: Api, prompts: Prompts, n: int, prompt_tokens: int,
                              output_tokens: int, timeout_s: float,
                              sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """`n` requests sent at once; figures over the wall time until the last one ends."""
    async with new_client(timeout_s) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            send(client, api, prompts.random(prompt_tokens, f"conc:{i}"), output_tokens,
                 sampling)
            for i in range(n)))
        wall = time.perf_counter() - start
    return concurrent_summary(results, wall)


def offered_load(trace: Sequence[rt.TraceRequest], prompts: Prompts, block_tokens: int,
                 time_scale: float, max_output: int) -> dict[str, float]:
    """What the replay asks per second: requests, prompt tokens, output tokens."""
    b = prompts.builder(block_tokens, 0)
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 * time_scale
    span = max(span, 1e-9)
    return {"span_s": span, "requests_s": len(trace) / span,
            "prompt_tok_s": sum(b.length(r) for r in trace) / span,
            "output_tok_s": sum(min(r.output_length, max_output) for r in trace) / span}


async def replay(api: Api, prompts: Prompts, trace: Sequence[rt.TraceRequest], block_tokens: int,
                 seed: int, time_scale: float, max_output: int,
                 timeout_s: float) -> list[Result]:
    """Each trace request at its scaled arrival time (replay_trace's prompts); all outcomes."""
    builder = prompts.builder(block_tokens, seed)
    t0 = trace[0].timestamp_ms if trace else 0.0
    async with new_client(timeout_s) as client:
        begin = time.perf_counter()

        async def one(i: int, req: rt.TraceRequest) -> Result:
            at = (req.timestamp_ms - t0) / 1000.0 * time_scale
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            r = await send(client, api, prompts.trace_prompt(builder, req, i),
                           max(1, min(req.output_length, max_output)))
            r.arrival_s = at
            return r

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(trace))))


def replay_summary(results: Sequence[Result], ttft_slo: float, tbt_slo: float,
                   wall_s: float) -> dict[str, Any]:
    """replay_trace's summary plus the count behind effective capacity."""
    s = rt.summarize(results, ttft_slo, tbt_slo)
    s.wall_s = wall_s
    d = asdict(s)
    d["within_slo_count"] = round(s.within_slo * s.requests) if s.requests else 0
    d.update({k: v for k, v in errors_of(results).items() if k in ("short", "first_error")})
    return d


# ---------------------------------------------------------------------------------------------
# Starting and stopping servers


def _parent_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pids: Sequence[int]) -> list[int]:
    """`pids` and every process below them (their children may sit in sessions of their own)."""
    children = _parent_map()
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, []))
    return seen


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def reap(pids: Sequence[int], wait_s: float = 10.0) -> None:
    """SIGKILL what is left of `pids` and their process groups; wait until all are gone."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    if left:
        print(f"  warning: processes {left} survived SIGKILL", file=sys.stderr)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a server log, for start-up errors."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Until /health answers 200 and /v1/models lists a model; a clear error otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up; "
                               f"log {log}:\n{log_tail(log)}")
        try:
            if (httpx.get(f"{url}/health", timeout=2).status_code == 200
                    and httpx.get(f"{url}/v1/models", timeout=5).json().get("data")):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready (/health, /v1/models) within {timeout_s:.0f} s; "
                       f"log {log}:\n{log_tail(log)}")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process's group, then SIGKILL whatever of its tree is left."""
    tree = descendants([proc.pid])
    # NOTE: SIGTERM, not Ctrl-C: after SIGINT transformers serve logs "Finished server
    # process" and then hangs on its continuous-batching thread; SIGTERM exits in seconds.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    reap(tree)
    proc.wait()


def tfserve_binary() -> str:
    """The `transformers` CLI of this interpreter's environment."""
    here = Path(sys.executable).with_name("transformers")
    return str(here) if here.exists() else (shutil.which("transformers") or "transformers")


@contextmanager
def start_tfserve(model: str, extra: Sequence[str], log_dir: Path,
                  timeout_s: float) -> Iterator[Api]:
    """`transformers serve --continuous-batching` on a free port, offline; stopped on exit."""
    from mooncake_testkit.ports import free_port_block

    port = free_port_block(1)
    argv = [tfserve_binary(), "serve", "--continuous-batching", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *extra, model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "tfserve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, timeout_s, log)
        yield Api("tfserve", url, rt._model_of(url, None))
    finally:
        stop_process(proc)


@contextmanager
def start_mooncake(spec: str, server_args: list[str], conductor_args: list[str],
                   log_dir: Path) -> Iterator[Api]:
    """replay_trace's launch of `--role spec`, then nothing left of its process tree."""
    tree: list[int] = []
    try:
        with ExitStack() as stack:
            try:
                cluster = stack.enter_context(rt.launch(spec, server_args, conductor_args,
                                                        log_dir))
            except RuntimeError as exc:
                logs = sorted(log_dir.glob(f"{spec}-*.log"))
                raise RuntimeError(f"--role {spec}: {exc}; log {logs[0] if logs else log_dir}:"
                                   f"\n{log_tail(logs[0]) if logs else ''}") from None
            try:
                yield Api("mooncake", cluster.url, rt._model_of(cluster.url, None))
            finally:
                # The supervisor's roles run in sessions of their own: its group is not theirs,
                # so they are found by parentage while it still lives.
                tree = descendants(cluster.pids)
    finally:
        reap(tree)


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
                    before = _load()
                    out[w] = run_workload(w, api, args, prompts, trace, sizes)
                    # Other work on the machine skews one system and not the next: keep the
                    # load next to each figure.
                    out.setdefault("load_avg_1m", {})[w] = [before, _load()]
                    print(f"  {w}: {time.perf_counter() - t1:.0f} s (load average {before:.1f}"
                          f" -> {_load():.1f})", flush=True)
                t2 = time.perf_counter()
            print(f"  stopped in {time.perf_counter() - t2:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - one broken system must not lose the others
            print(f"  {label} failed: {exc}", file=sys.stderr, flush=True)
            out.setdefault("errors", []).append(f"{phase}: {exc}")
    return out


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def launch_system(name: str, args: argparse.Namespace, log_dir: Path,
                  slo: bool) -> AbstractContextManager[Api]:
    """The context manager that starts system `name` (and stops it fully on exit)."""
    if name == "tfserve":
        return start_tfserve(args.model, shlex.split(args.tf_args), log_dir,
                             args.startup_timeout)
    own = args.all_args if name == "all" else args.colocated_args
    server_args = ["--model", args.model, *shlex.split(args.mooncake_args), *shlex.split(own)]
    conductor_args = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)] \
        if slo else []
    return start_mooncake(name, server_args, conductor_args, log_dir / (name + "-slo" * slo))


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


def json_safe(x: Any) -> Any:
    """`x` with nan / inf as null, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


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
