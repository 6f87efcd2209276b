#!/usr/bin/env python3
"""Transfer-engine benchmark: GB/s and p50/p99 latency of the shm and TCP transports, against
baselines measured in the same run.

    .venv/bin/python scripts/bench_transfer.py [--budget 0.6] [--no-mooncake] [--no-checksums]

Every case READs from a segment served by another process into local memory: one request of
64 KiB / 1 MiB / 16 MiB / 64 MiB ("1x"), and the same bytes as a batch of 64 slices ("64x",
the KV-block pattern). Baselines: (a) memcpy of the same sizes (the ceiling), (b) plain-Python
asyncio streams (what a naive implementation gets), (c) blocking sockets with recv_into (the best
a pure-Python path gets), (d) Mooncake's own TransferEngine over TCP when importable
(`pip install -e '.[bench]'`, needs Debian's libibverbs1; it binds wildcard addresses, so it runs
inside `unshare -n`). Prints a table, then each transport's ratio against each baseline.
Checksummed READs (skip with --no-checksums): "+crc" has the engine compute each request's
CRC32C as its bytes land (checksums=True), "+2pass" is a plain READ followed by crc32c_many over
what landed; both are compared with each other and with the plain READ.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
SLICES = 64
SEG = 64 * MiB
SECRET = b"bench-secret"
REQ = struct.Struct("<QQ")  # offset, length: the socket baselines' request


class Result(NamedTuple):
    """One measured case."""

    method: str
    size: int
    mode: str  # "1x" or "64x"
    gbps: float
    p50_us: float
    p99_us: float
    iters: int


def measure(method: str, size: int, mode: str, once: Callable[[], None],
            budget_s: float) -> Result:
    """Run `once` (moves `size` bytes) repeatedly for ~budget_s after a warm-up."""
    once()
    lat: list[float] = []
    start = time.perf_counter()
    while more(lat, start, budget_s):
        t = time.perf_counter()
        once()
        lat.append(time.perf_counter() - t)
    return summarize(method, size, mode, lat)


async def measure_async(method: str, size: int, mode: str,
                        once: Callable[[], Awaitable[None]], budget_s: float) -> Result:
    """measure() for a coroutine, timed inside the event loop."""
    await once()
    lat: list[float] = []
    start = time.perf_counter()
    while more(lat, start, budget_s):
        t = time.perf_counter()
        await once()
        lat.append(time.perf_counter() - t)
    return summarize(method, size, mode, lat)


def more(lat: list[float], start: float, budget_s: float) -> bool:
    """At least 5 runs, then until the time budget (or 20000 runs) is spent."""
    return len(lat) < 5 or (time.perf_counter() - start < budget_s and len(lat) < 20000)


def summarize(method: str, size: int, mode: str, lat: list[float]) -> Result:
    """GB/s over all runs, and the latency percentiles."""
    lat.sort()
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    return Result(method, size, mode, size * len(lat) / sum(lat) / 1e9,
                  statistics.median(lat) * 1e6, p99 * 1e6, len(lat))


def pieces(size: int, mode: str) -> list[tuple[int, int]]:
    """(offset, length) of each request: one, or SLICES equal slices."""
    if mode == "1x":
        return [(0, size)]
    step = size // SLICES
    return [(i * step, step) for i in range(SLICES)]


def addr(buf: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


# ---- servers (separate processes) -----------------------------------------------------------

def engine_server(q: Any) -> None:
    """Our engine, serving a SEG-byte shared segment 'kv'."""
    from mooncake_server.transfer import TransferEngine

    engine = TransferEngine(secret=SECRET)
    seg = engine.alloc_shared("kv", SEG)
    seg[:] = os.urandom(SEG)
    q.put(engine.address)
    threading.Event().wait()


def socket_server(q: Any) -> None:
    """Blocking sockets (one thread per connection) and asyncio streams, same payload bytes."""
    data = memoryview(os.urandom(SEG))

    def serve_blocking(conn: socket.socket) -> None:
        while len(hdr := conn.recv(REQ.size, socket.MSG_WAITALL)) == REQ.size:
            off, n = REQ.unpack(hdr)
            conn.sendall(data[off:off + n])

    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            tune(conn)
            threading.Thread(target=serve_blocking, args=(conn,), daemon=True).start()

    async def serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                off, n = REQ.unpack(await reader.readexactly(REQ.size))
                writer.write(data[off:off + n])
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve_stream, "127.0.0.1", 0)
        q.put((listener.getsockname()[1], server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    threading.Thread(target=accept, daemon=True).start()
    asyncio.run(main())


def tune(sock: socket.socket) -> None:
    """The same socket options our engine uses, so the baseline is not handicapped."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)


def spawn(target: Callable[[Any], None]) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q,), daemon=True)
    proc.start()
    return proc, q.get(timeout=60)


# ---- cases ----------------------------------------------------------------------------------

def bench_memcpy(budget: float) -> list[Result]:
    src, dst = bytearray(os.urandom(SEG)), bytearray(SEG)
    s, d = addr(src), addr(dst)
    out = []
    for size in SIZES:
        for mode in ("1x", "64x"):
            parts = pieces(size, mode)

            def once(parts: list[tuple[int, int]] = parts) -> None:
                for off, n in parts:
                    ctypes.memmove(d + off, s + off, n)
            out.append(measure("memcpy", size, mode, once, budget))
    return out


def bench_engine(address: str, budget: float, checksums: bool) -> list[Result]:
    """READs over shm and TCP; with `checksums`, also each READ checksummed by the engine as it
    lands ("+crc") and, as its baseline, a plain READ then a CRC32C pass over what landed
    ("+2pass", what a reader verifying its bytes did before)."""
    from mooncake_server.transfer import Op, TransferEngine, TransferRequest, crc32c_many

    out = []
    for transport in ("shm", "tcp"):
        with TransferEngine(secret=SECRET, transport=transport, serve=False) as engine:
            local = engine.alloc_shared("local", SEG)
            base = addr(local)
            handle = engine.open_segment(address, "kv")
            assert engine.transport_of(handle) == transport
            for size in SIZES:
                for mode in ("1x", "64x"):
                    reqs = [TransferRequest(Op.READ, base + off, handle, off, n)
                            for off, n in pieces(size, mode)]
                    addrs, sizes = [r.local_addr for r in reqs], [r.length for r in reqs]

                    def once(reqs: list[TransferRequest] = reqs, fused: bool = False,
                             second_pass: bool = False, addrs: list[int] = addrs,
                             sizes: list[int] = sizes) -> None:
                        batch = engine.allocate_batch(len(reqs))
                        engine.submit_transfer(batch, reqs, fused)
                        engine.wait_sync(batch)
                        if fused:
                            engine.get_checksums(batch)
                        engine.free_batch(batch)
                        if second_pass:
                            crc32c_many(addrs, sizes)
                    out.append(measure(transport, size, mode, once, budget))
                    if checksums:
                        out.append(measure(f"{transport}+crc", size, mode,
                                           lambda once=once: once(fused=True), budget))
                        out.append(measure(f"{transport}+2pass", size, mode,
                                           lambda once=once: once(second_pass=True), budget))
    return out


def bench_recv_into(port: int, budget: float) -> list[Result]:
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock)
    dst = memoryview(bytearray(SEG))
    out = []
    for size in SIZES:
        for mode in ("1x", "64x"):
            parts = pieces(size, mode)
            reqs = b"".join(REQ.pack(off, n) for off, n in parts)

            def once(parts: list[tuple[int, int]] = parts, reqs: bytes = reqs) -> None:
                sock.sendall(reqs)  # pipelined, like the engine's batch
                for off, n in parts:
                    view, got = dst[off:off + n], 0
                    while got < n:
                        got += sock.recv_into(view[got:])
            out.append(measure("recv_into", size, mode, once, budget))
    sock.close()
    return out


def bench_asyncio(port: int, budget: float) -> list[Result]:
    dst = bytearray(SEG)

    async def main() -> list[Result]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        out = []
        for size in SIZES:
            for mode in ("1x", "64x"):
                parts = pieces(size, mode)
                reqs = b"".join(REQ.pack(off, n) for off, n in parts)

                async def once(parts: list[tuple[int, int]] = parts, reqs: bytes = reqs) -> None:
                    writer.write(reqs)
                    await writer.drain()
                    for off, n in parts:
                        dst[off:off + n] = await reader.readexactly(n)
                out.append(await measure_async("asyncio", size, mode, once, budget))
        writer.close()
        return out
    return asyncio.run(main())


# ---- Mooncake's TransferEngine (runs inside `unshare -n`) -------------------------------------

def mooncake_server(q: Any) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    buf = ctypes.create_string_buffer(os.urandom(SEG), SEG)
    if engine.register_memory(ctypes.addressof(buf), SEG):
        raise RuntimeError("Mooncake register_memory failed")
    q.put((engine.get_rpc_port(), ctypes.addressof(buf)))
    threading.Event().wait()


def mooncake_worker(budget: float) -> None:
    """Inside a fresh network namespace: print Mooncake TCP results as JSON lines."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    from mooncake.engine import TransferEngine

    proc, (port, raddr) = spawn(mooncake_server)
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    buf = ctypes.create_string_buffer(SEG)
    base = ctypes.addressof(buf)
    if engine.register_memory(base, SEG):
        raise RuntimeError("Mooncake register_memory failed")
    target = f"127.0.0.1:{port}"
    for size in SIZES:
        for mode in ("1x", "64x"):
            parts = pieces(size, mode)
            locs = [base + off for off, _ in parts]
            rems = [raddr + off for off, _ in parts]
            lens = [n for _, n in parts]

            def once(locs: list[int] = locs, rems: list[int] = rems,
                     lens: list[int] = lens) -> None:
                rc = (engine.transfer_sync_read(target, locs[0], rems[0], lens[0])
                      if len(lens) == 1 else
                      engine.batch_transfer_sync_read(target, locs, rems, lens))
                if rc:
                    raise RuntimeError(f"Mooncake transfer failed with code {rc}")
            print(json.dumps(measure("mooncake", size, mode, once, budget)._asdict()),
                  flush=True)
    proc.kill()


def bench_mooncake(budget: float) -> tuple[list[Result], str]:
    """Mooncake's numbers, or why there are none."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return [], f"not importable ({exc}); pip install -e '.[bench]' (needs libibverbs1)"
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return [], "needs root and unshare(1): it binds wildcard addresses"
    cmd = ["unshare", "-n", sys.executable, os.path.abspath(__file__), "--mooncake-worker",
           "--budget", str(budget)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    rows = [Result(**json.loads(line)) for line in run.stdout.splitlines()
            if line.startswith("{")]
    if run.returncode or not rows:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return rows, f"failed (exit {run.returncode}): {tail}"
    return rows, ""


# ---- report -------------------------------------------------------------------------------

def human(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def report(results: list[Result], mooncake_note: str) -> None:
    by = {(r.method, r.size, r.mode): r for r in results}
    methods = [m for m in ("shm", "shm+crc", "shm+2pass", "tcp", "tcp+crc", "tcp+2pass",
                           "memcpy", "recv_into", "asyncio", "mooncake")
               if any(r.method == m for r in results)]
    print(f"\n{'size':>7} {'batch':>5} {'method':>10} {'GB/s':>8} {'p50 us':>10} "
          f"{'p99 us':>10} {'iters':>6}")
    for size in SIZES:
        for mode in ("1x", "64x"):
            for m in methods:
                if r := by.get((m, size, mode)):
                    print(f"{human(size):>7} {mode:>5} {m:>10} {r.gbps:8.2f} {r.p50_us:10.1f} "
                          f"{r.p99_us:10.1f} {r.iters:6d}")
    if mooncake_note:
        print(f"\nMooncake TransferEngine: {mooncake_note}")
    pairs = [("shm", "memcpy", 0.8), ("tcp", "recv_into", 1.1), ("tcp", "asyncio", 2.0),
             ("tcp", "mooncake", 2.0)]
    print("\nratios of GB/s (target at >= 1 MiB in brackets)")
    print(f"{'size':>7} {'batch':>5} " + " ".join(f"{a + '/' + b:>16}" for a, b, _ in pairs))
    for size in SIZES:
        for mode in ("1x", "64x"):
            cells = []
            for a, b, target in pairs:
                ra, rb = by.get((a, size, mode)), by.get((b, size, mode))
                if not (ra and rb):
                    cells.append(f"{'-':>16}")
                    continue
                ratio = ra.gbps / rb.gbps
                mark = "" if size < MiB else (" ok" if ratio >= target else " LOW")
                cells.append(f"{f'{ratio:.2f}x [{target}]{mark}':>16}")
            print(f"{human(size):>7} {mode:>5} " + " ".join(cells))
    if any(r.method == "shm+crc" for r in results):
        print("\nchecksummed READs, GB/s ratios: fused (engine CRCs as bytes land) against a "
              "second pass, and against no checksum")
        print(f"{'size':>7} {'batch':>5} {'shm fused/2pass':>16} {'shm fused/plain':>16} "
              f"{'tcp fused/2pass':>16} {'tcp fused/plain':>16}")
        for size in SIZES:
            for mode in ("1x", "64x"):
                cells = []
                for t in ("shm", "tcp"):
                    fused = by.get((f"{t}+crc", size, mode))
                    for base in (f"{t}+2pass", t):
                        other = by.get((base, size, mode))
                        cells.append(f"{fused.gbps / other.gbps:15.2f}x" if fused and other
                                     else f"{'-':>16}")
                print(f"{human(size):>7} {mode:>5} " + " ".join(cells))
    if tcp := by.get(("tcp", 64 * KiB, "1x")):
        verdict = "ok" if tcp.p50_us < 200 else "LOW"
        print(f"\n64 KiB TCP round trip p50: {tcp.p50_us:.0f} us [target < 200 us] {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=0.6,
                        help="seconds of measurement per case (default 0.6)")
    parser.add_argument("--no-mooncake", action="store_true",
                        help="skip Mooncake's TransferEngine baseline")
    parser.add_argument("--no-checksums", action="store_true",
                        help="skip the checksummed-READ rows (fused and second pass)")
    parser.add_argument("--mooncake-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mooncake_worker:
        mooncake_worker(args.budget)
        return
    started = time.monotonic()
    engine_proc, address = spawn(engine_server)
    sock_proc, (blocking_port, asyncio_port) = spawn(socket_server)
    results: list[Result] = []
    try:
        for name, run in (("memcpy", lambda: bench_memcpy(args.budget)),
                          ("shm + tcp", lambda: bench_engine(address, args.budget,
                                                             not args.no_checksums)),
                          ("recv_into", lambda: bench_recv_into(blocking_port, args.budget)),
                          ("asyncio", lambda: bench_asyncio(asyncio_port, args.budget))):
            print(f"measuring {name}...", file=sys.stderr, flush=True)
            results += run()
    finally:
        engine_proc.kill()
        sock_proc.kill()
    note = "skipped (--no-mooncake)"
    if not args.no_mooncake:
        print("measuring Mooncake TransferEngine (TCP, in unshare -n)...", file=sys.stderr,
              flush=True)
        rows, note = bench_mooncake(args.budget)
        results += rows
    report(results, note)
    print(f"\n({os.cpu_count()} CPUs, {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
