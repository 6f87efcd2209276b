#!/usr/bin/env python3
"""Fault drill: inject every kind of fault into a live cluster while requests stream; count what
was survived, requests lost, and output tokens lost or duplicated.

  .venv/bin/python scripts/fault_drill.py               # 3 rounds of 7 kinds, ~6 min here
  .venv/bin/python scripts/fault_drill.py --rounds 1 --streams 2

Starts a conductor (--replicas 2), two store nodes, two prefill and two decode instances as
separate processes. Each round injects, in turn, while --streams greedy completions run:
  decode_kill    SIGKILL the decode instance serving a stream (then restart it)
  decode_stall   SIGSTOP it until the conductor has moved its streams (then SIGCONT)
  decode_drain   SIGTERM it: it finishes its streams, takes no new one (then restart it)
  migrate        POST /internal/migrate for every decoding stream (load shift)
  prefill_kill   SIGKILL the prefill instance holding a job (then restart it)
  store_kill     SIGKILL a store node (two replicas) while streams run (then restart it)
  conductor      restart the conductor between batches; the next batch must work
Afterwards every prompt is run again on the healthy cluster: a stream survived when its tokens
equal that uninterrupted output. Lost / duplicated tokens are counted by aligning the two.
At the end the cluster must be idle again: nothing in flight, leased (pinned), reserved, or
held by a decode instance (its /metrics and free KV blocks against the count before the drill).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import mkdtemp

import httpx

from mooncake_testkit.role_procs import RoleCluster

MODEL = "SmolLM2-135M-Instruct"
KINDS = ("decode_kill", "decode_stall", "decode_drain", "migrate", "prefill_kill",
         "store_kill", "conductor")
DECODES, PREFILLS, STORES = ("decode-0", "decode-1"), ("prefill-0", "prefill-1"), (
    "store-0", "store-1")


@dataclass
class Stream:
    """One streamed greedy completion as the client saw it."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    request_id: str = ""
    error: str | None = None


async def stream(url: str, s: Stream, max_tokens: int) -> Stream:
    """Run `s` to its end (errors are recorded, not raised)."""
    body = {"model": MODEL, "prompt": s.prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    try:
        async with (httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10)) as http,
                    http.stream("POST", url + "/v1/completions", json=body) as r):
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    s.request_id = chunk["id"]
                    for choice in chunk.get("choices", []):
                        s.tokens += choice.get("token_ids") or []
    except httpx.HTTPError as exc:
        s.error = repr(exc)
    return s


def running(cluster: RoleCluster) -> dict[str, dict[str, object]]:
    """The conductor's requests in flight, by id ({} while it is down)."""
    try:
        r = httpx.get(cluster.url + "/internal/requests", headers=cluster.headers, timeout=5)
        return {item["request_id"]: item for item in r.json()} if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def wait_for(predicate: Callable[[], object], timeout_s: float) -> object:
    """Poll until truthy (returned) or the deadline (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(0.05)
    return None


def busy(cluster: RoleCluster, role_prefix: str, phase: str, min_tokens: int = 0) -> str | None:
    """An instance serving a request in `phase` (after `min_tokens` tokens)."""
    for item in running(cluster).values():
        iid = str(item["instance_id"])
        if (item["phase"] == phase and iid.startswith(role_prefix)
                and int(str(item["tokens"])) >= min_tokens):
            return iid
    return None


async def restart(cluster: RoleCluster, name: str) -> None:
    """Start `name` again and wait until it is registered."""
    cluster[name].start()
    await asyncio.to_thread(cluster.wait_registered, [name], 180)


async def inject(kind: str, cluster: RoleCluster) -> bool:
    """Inject one fault of `kind` into the streams now running; False if none could be."""
    if kind in ("decode_kill", "decode_stall", "decode_drain"):
        victim = await wait_for(lambda: busy(cluster, "decode-", "decode", 8), 60)
        if not victim:
            return False
        proc = cluster[str(victim)]
        if kind == "decode_kill":
            proc.kill()
            await restart(cluster, proc.name)
        elif kind == "decode_stall":
            proc.signal(signal.SIGSTOP)
            await wait_for(lambda: busy(cluster, proc.name, "decode") is None, 60)
            proc.signal(signal.SIGCONT)
            await asyncio.to_thread(cluster.wait_registered, [proc.name], 60)
        else:
            proc.signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 120)
            await restart(cluster, proc.name)
        return True
    if kind == "migrate":
        if not await wait_for(lambda: busy(cluster, "decode-", "decode", 8), 60):
            return False
        async with httpx.AsyncClient(headers=cluster.headers, timeout=5) as http:
            for rid, item in running(cluster).items():
                if item["phase"] == "decode":
                    await http.post(cluster.url + "/internal/migrate", json={"request_id": rid})
        return True
    if kind == "prefill_kill":
        victim = await wait_for(lambda: busy(cluster, "prefill-", "prefill"), 60)
        if not victim:
            return False
        cluster[str(victim)].kill()
        await restart(cluster, str(victim))
        return True
    if kind == "store_kill":
        if not await wait_for(lambda: busy(cluster, "decode-", "decode", 4), 60):
            return False
        name = random.choice(STORES)
        cluster[name].kill()
        await restart(cluster, name)
        return True
    raise ValueError(kind)


@dataclass
class Tally:
    """Per kind of fault."""

    injected: int = 0
    survived: int = 0  # injections after which every stream equals its reference
    requests: int = 0
    requests_lost: int = 0  # errored streams
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    moves: int = 0  # requests the conductor moved or re-sent meanwhile (its /metrics)


def conductor_moves(cluster: RoleCluster) -> int:
    """Decode moves + prefill re-sends the conductor counted (0 while it is down)."""
    try:
        text = httpx.get(cluster.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("mooncake_conductor_decode_moves_total",
                                       "mooncake_conductor_prefill_resends_total"))))


def compare(got: Sequence[int], want: Sequence[int]) -> tuple[int, int]:
    """(lost, duplicated/extra) output tokens of `got` against `want`."""
    lost = extra = 0
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=want, b=got,
                                                      autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += a1 - a0
        if op in ("insert", "replace"):
            extra += b1 - b0
    return lost, extra


async def round_of(kind: str, cluster: RoleCluster, n: int, max_tokens: int,
                   rnd: random.Random) -> tuple[list[Stream], bool]:
    """One batch of streams with one fault of `kind` injected; (streams, injected)."""
    long = kind == "prefill_kill"  # long, fresh prompts keep prefill busy long enough
    prompts = [[rnd.randrange(1000, 40000) for _ in range(600 if long else rnd.randrange(20, 90))]
               for _ in range(n)]
    streams = [Stream(p) for p in prompts]
    if kind == "conductor":
        cluster["conductor"].kill()
        cluster["conductor"].start()
        await asyncio.to_thread(cluster.wait_registered,
                                [x for x in cluster.procs if x != "conductor"], 180)
        await asyncio.gather(*[stream(cluster.url, s, max_tokens) for s in streams])
        return streams, True
    tasks = [asyncio.create_task(stream(cluster.url, s, max_tokens)) for s in streams]
    injected = await inject(kind, cluster)
    await asyncio.gather(*tasks)
    return streams, injected


def launch(log_dir: Path) -> RoleCluster:
    """The 7-process cluster, with heartbeats fast enough to notice a silent instance in 2 s."""
    common = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2", "--log-level",
              "warning"]
    engine = ["--kv-memory", "256MiB", "--torch-threads", "1"]
    cluster = RoleCluster(log_dir=log_dir, common=common)
    cluster.add("conductor", "conductor", "--replicas", "2")
    for name in STORES:
        cluster.add("store", name, "--memory", "256MiB")
    for p, d in zip(PREFILLS, DECODES):
        cluster.add("prefill", p, *engine)
        cluster.add("decode", d, *engine, "--drain-timeout", "120")
    return cluster.start()


async def drill(cluster: RoleCluster, rounds: int, n: int, max_tokens: int,
                kinds: Sequence[str], progress: Callable[[str], None]) -> dict[str, Tally]:
    """Every kind, `rounds` times; tallies by kind."""
    rnd = random.Random(0)
    tallies = {k: Tally() for k in kinds}
    for r in range(rounds):
        for kind in kinds:
            before = conductor_moves(cluster)
            streams, injected = await round_of(kind, cluster, n, max_tokens, rnd)
            t = tallies[kind]
            t.moves += max(0, conductor_moves(cluster) - before)
            t.injected += injected
            clean = True
            for s in streams:
                t.requests += 1
                want = (await stream(cluster.url, Stream(s.prompt), max_tokens)).tokens
                lost, extra = compare(s.tokens, want)
                t.tokens_lost += lost
                t.tokens_duplicated += extra
                if s.error:
                    t.requests_lost += 1
                clean = clean and not s.error and s.tokens == want and len(want) == max_tokens
            t.survived += injected and clean
            progress(f"round {r + 1} {kind}: injected={injected} clean={clean}")
    return tallies


async def _main_async(a: argparse.Namespace, cluster: RoleCluster) -> dict[str, Tally]:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    return await drill(cluster, a.rounds, a.streams, a.max_tokens, a.kinds, say)


def main(argv: Sequence[str] | None = None) -> None:
    """Launch, drill, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=3, help="concurrent streams per fault (3)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--log-dir", help="role logs (default: a temporary directory)")
    a = p.parse_args(argv)
    with launch(Path(a.log_dir or mkdtemp(prefix="mooncake-drill-"))) as cluster:
        idle = cluster.free_blocks()
        tallies = asyncio.run(_main_async(a, cluster))
        left = cluster.wait_idle(idle)  # store leases of a killed client expire in 30 s
    print(f"{'fault':<14}{'injected':>9}{'survived':>9}{'requests':>9}{'lost':>6}"
          f"{'tok lost':>9}{'tok dup':>8}{'moves':>7}")
    total = Tally(*(sum(getattr(t, f) for t in tallies.values()) for f in Tally.__annotations__))
    for kind, t in [*tallies.items(), ("total", total)]:
        print(f"{kind:<14}{t.injected:>9}{t.survived:>9}{t.requests:>9}{t.requests_lost:>6}"
              f"{t.tokens_lost:>9}{t.tokens_duplicated:>8}{t.moves:>7}")
    print("left in flight / pinned after the drill:", left or "nothing")
    ok = total.requests_lost == total.tokens_lost == total.tokens_duplicated == 0 and not left
    sys.exit(0 if ok and total.survived == total.injected else 1)


if __name__ == "__main__":
    main()
