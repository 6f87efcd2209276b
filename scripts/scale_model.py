"""Where one conductor stops: its registry, store index and scheduler driven in one process at
cluster sizes past one box, with no model, no network and no other roles.

For each N (instances per role: N store, N prefill, N decode, registered and heartbeating) and
M (block keys reported into the global store index, spread over the store nodes) it prints:
  sched p50/p99  one request's placement: the prefix lookup of its 64 block keys in the index
                 plus Algorithm 1 over the N prefill and N decode instances (KVCacheScheduler.plan)
  index B/key    resident memory the index grew by, per key (RSS, after a collection)
  hb us          one heartbeat handled (JSON body parsed + registry updated)
  report us/key  one key of a store node's delta report handled (parsed + applied)
  load %         one core's share spent on what N instances send each second at the default
                 intervals (a heartbeat per second each; the store nodes' deltas at `--puts` keys/s)
HTTP and uvicorn's own cost are not counted: the figures are the conductor's work, a floor.
Every time is this thread's CPU time, not wall time, so that other processes on a shared machine
do not inflate it (a loaded conductor's wall times are longer by its wait for a core).

Usage: python scripts/scale_model.py [--n 10,100,1000] [--m 1e5,1e6,1e7] [--puts 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mooncake_server.api.backend import GenerateRequest
from mooncake_server.config import ServerConfig
from mooncake_server.roles.conductor.master_link import LocalMaster
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler import build_scheduler
from mooncake_server.roles.conductor.scheduler.local_index import LocalCacheIndex
from mooncake_server.roles.master.master import StoreMaster
from mooncake_server.wire.index import StoreEntry, StoreReport
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import SamplingParams

BLOCK_BYTES = 1 << 20
PROMPT_BLOCKS = 64  # a 1,024-token prompt at 16 tokens per block
CHUNK = 50_000  # keys per report while filling the index (a real snapshot is one report)


def rss_bytes() -> int:
    """This process's resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def key(i: int) -> str:
    """A block key shaped like the real ones (a hex digest)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()


def register(registry: InstanceRegistry, n: int) -> None:
    """N instances of each role."""
    for role in ("store", "prefill", "decode"):
        for i in range(n):
            registry.register(InstanceInfo(
                instance_id=f"{role}-{i}", role=role, url=f"http://10.0.{i // 250}.{i % 250}:1",
                transfer_address=f"10.0.0.{i % 250}:2" if role == "store" else None,
                segment="pool" if role == "store" else None, incarnation="x"))


def fill(master: StoreMaster, n: int, m: int) -> None:
    """M keys over the N store nodes, in delta reports of CHUNK keys."""
    seq = {}
    for start in range(0, m, CHUNK):
        node = f"store-{(start // CHUNK) % n}"
        seq[node] = seq.get(node, 0) + 1
        entries = [StoreEntry(key=key(i), size=BLOCK_BYTES, tier="dram")
                   for i in range(start, min(m, start + CHUNK))]
        master.report(StoreReport(node_id=node, epoch="e", seq=seq[node],
                                  snapshot=seq[node] == 1, entries=entries))


def time_heartbeat(registry: InstanceRegistry, n: int, rounds: int = 20_000) -> float:
    """Seconds per heartbeat, body parsing included."""
    bodies = [Heartbeat(instance_id=f"decode-{i % n}", running=3, waiting=1,
                        free_blocks=1000).model_dump_json().encode() for i in range(rounds)]
    start = time.thread_time()
    for body in bodies:
        registry.heartbeat(Heartbeat.model_validate_json(body))
    return (time.thread_time() - start) / rounds


def time_report(master: StoreMaster, m: int, keys_per_report: int = 64,
                rounds: int = 300) -> float:
    """Seconds per reported key, a delta of `keys_per_report` keys parsed and applied."""
    seq = 10**9
    bodies = []
    for r in range(rounds):
        entries = [StoreEntry(key=key(m + r * keys_per_report + j), size=BLOCK_BYTES,
                              tier="dram") for j in range(keys_per_report)]
        seq += 1
        bodies.append(StoreReport(node_id="store-0", epoch="e", seq=seq,
                                  entries=entries).model_dump_json().encode())
    master.index._streams["store-0"] = ("e", 10**9)  # NOTE: continue the fill's stream
    start = time.thread_time()
    for body in bodies:
        master.report(StoreReport.model_validate_json(body))
    return (time.thread_time() - start) / (rounds * keys_per_report)


async def time_schedule(scheduler, m: int, rounds: int) -> list[float]:  # noqa: ANN001
    """Seconds per placement of a 64-block prompt whose first half is in the index."""
    out = []
    sampling = SamplingParams(max_tokens=64)
    for r in range(rounds):
        base = (r * 977) % max(1, m - PROMPT_BLOCKS)
        keys = [key(base + j) for j in range(PROMPT_BLOCKS // 2)] + \
            [key(m * 2 + r * PROMPT_BLOCKS + j) for j in range(PROMPT_BLOCKS // 2)]
        request = GenerateRequest(f"r{r}", list(range(PROMPT_BLOCKS * 16)), sampling)
        start = time.thread_time()
        plan = await scheduler.plan(request, keys)
        out.append(time.thread_time() - start)
        assert plan is not None
        scheduler.release(request.request_id)
    return out


async def measure(n: int, m: int, puts_per_s: int) -> dict[str, float]:
    """One row of the table."""
    config = ServerConfig(role="conductor")
    registry = InstanceRegistry(heartbeat_timeout_s=1e9)
    master = StoreMaster(registry, 1, "secret")
    scheduler = build_scheduler(config, registry, LocalMaster(master), local=LocalCacheIndex())
    register(registry, n)
    gc.collect()
    before = rss_bytes()
    started = time.thread_time()
    fill(master, n, m)
    fill_s = time.thread_time() - started
    gc.collect()
    per_key = (rss_bytes() - before) / m
    sched = sorted(await time_schedule(scheduler, m, rounds=200 if n >= 1000 else 1000))
    hb = time_heartbeat(registry, n)
    rep = time_report(master, m)
    load = 3 * n * hb + puts_per_s * rep
    return {"sched_p50_us": sched[len(sched) // 2] * 1e6,
            "sched_p99_us": sched[int(len(sched) * 0.99)] * 1e6,
            "sched_mean_us": statistics.fmean(sched) * 1e6,
            "bytes_per_key": per_key, "hb_us": hb * 1e6, "report_us_per_key": rep * 1e6,
            "load_pct": 100 * load, "fill_s": fill_s}


def main() -> None:
    """Print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="10,100,1000", help="instances per role (comma list)")
    p.add_argument("--m", default="1e5,1e6,1e7", help="keys in the index (comma list)")
    p.add_argument("--puts", type=int, default=10_000,
                   help="keys/s the store nodes report in all (for the load column)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # N,M: one row as JSON (a child process)
    args = p.parse_args()
    if args.one:
        n, m = (int(float(x)) for x in args.one.split(","))
        print(json.dumps(asyncio.run(measure(n, m, args.puts))))
        return
    ns = [int(x) for x in args.n.split(",")]
    ms = [int(float(x)) for x in args.m.split(",")]
    print("| N/role | M keys | sched p50 us | sched p99 us | index B/key | hb us | "
          "report us/key | load % of a core | fill s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in ms:
        for n in ns:
            # NOTE: each row in a fresh process: what earlier rows left on the heap (and the
            # collector's work over it) would otherwise be charged to the later ones.
            out = subprocess.run([sys.executable, __file__, "--one", f"{n},{m}", "--puts",
                                  str(args.puts)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {n:,} | {m:,} | {row['sched_p50_us']:.0f} | {row['sched_p99_us']:.0f} | "
                  f"{row['bytes_per_key']:.0f} | {row['hb_us']:.1f} | "
                  f"{row['report_us_per_key']:.2f} | {row['load_pct']:.1f} | "
                  f"{row['fill_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
