#!/usr/bin/env python
"""Benchmark the store: put/get of 64 KiB, 1 MiB and 4 MiB values from another process, against
memcpy, the bare TCP floor, Redis (redis-server on 127.0.0.1, redis-py + hiredis) and Mooncake
Store when importable.

    .venv/bin/python scripts/bench_store.py [--iters 40] [--skip-redis] [--skip-mooncake]
        [--skip-api]

Our store: a `--role store` process (DRAM pool registered with the transfer engine) and the real
store-index routes in this process; the client is this process, over shared memory (same host)
and TCP. Mooncake Store: `mooncake_master` + a holder process that mounts the segment + a client
process, P2PHANDSHAKE metadata, protocol tcp, all inside `unshare -n` (it binds wildcard
addresses), run by the wheel's own environment (.venv-mooncake-ref, scripts/setup.sh --test).
The API path: batch_put_from / batch_get_into of 16 values through Mooncake's client API, ours
(a pure client, a `--role master` and a `--role store` process) against the real wheel's (a
pure client and a holder), TCP both (mooncake_bench/mooncake_calls.py). Every figure is printed
next to the baselines measured in the same run. Needs: `pip install -e .[bench]`
(redis[hiredis]) and Debian `redis-server`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES = [64 << 10, 1 << 20, 4 << 20]
SECRET = "bench-store-secret"
BATCH = 16


@dataclass
class Row:
    """One measured operation."""

    system: str
    path: str
    size: int
    op: str
    lat: list[float]  # seconds per call
    per_call: int = 1  # values moved per call

    @property
    def samples(self) -> list[float]:
        """Every call but the first, which pays one-time costs (connections, first touch of
        buffers) in every system alike."""
        return self.lat[1:] if len(self.lat) > 1 else self.lat

    @property
    def gbps(self) -> float:
        return self.size * self.per_call * len(self.samples) / sum(self.samples) / 1e9

    @property
    def ops(self) -> float:
        return self.per_call * len(self.samples) / sum(self.samples)

    def pct(self, q: float) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def addr_of(buf: object) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]


def iters_for(size: int, iters: int) -> int:
    return max(8, min(iters, (512 << 20) // (size * BATCH)))


# ---- memcpy ---------------------------------------------------------------------------------

def bench_memcpy(iters: int) -> list[Row]:
    rows = []
    for size in SIZES:
        src = bytearray(os.urandom(size))
        dst = bytearray(size)
        s, d = addr_of(src), addr_of(dst)
        lat = []
        for _ in range(iters_for(size, iters) * 4):
            t = time.perf_counter()
            ctypes.memmove(d, s, size)
            lat.append(time.perf_counter() - t)
        rows.append(Row("memcpy", "in-process", size, "copy", lat))
        # The same bytes a batched get moves: BATCH distinct values, so not all cache-hot.
        src = bytearray(os.urandom(size * BATCH))
        dst = bytearray(size * BATCH)
        s, d = addr_of(src), addr_of(dst)
        lat = []
        for _ in range(iters_for(size, iters) * 2):
            t = time.perf_counter()
            for i in range(BATCH):
                ctypes.memmove(d + i * size, s + i * size, size)
            lat.append(time.perf_counter() - t)
        rows.append(Row("memcpy", "in-process", size, f"copy x{BATCH}", lat, BATCH))
    return rows


# ---- the TCP floor ---------------------------------------------------------------------------

def serve_floor(port: int) -> None:
    """--floor-server: answer each 8-byte size request with that many bytes from memory."""
    with socket.create_server(("127.0.0.1", port)) as listener:
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    value = memoryview(os.urandom(max(SIZES)))
    with conn:
        while head := conn.recv(8):
            conn.sendall(value[:int.from_bytes(head, "little")])


def bench_tcp_floor(iters: int) -> list[Row]:
    """What one TCP stream does here with nothing on top: a kept-open loopback connection to
    another process that sends the value straight from memory, received with recv_into into
    the destination; no protocol, no lookup, no checksum (several streams can beat it)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--floor-server", str(port)],
                            start_new_session=True)
    rows = []
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("floor server did not start") from None
                time.sleep(0.05)
        with conn:
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for size in SIZES:
                dst = memoryview(bytearray(size))
                lat = []
                for _ in range(iters_for(size, iters) * 2):
                    t = time.perf_counter()
                    conn.sendall(size.to_bytes(8, "little"))
                    got = 0
                    while got < size:
                        n = conn.recv_into(dst[got:])
                        if not n:
                            raise RuntimeError("floor server closed the connection")
                        got += n
                    lat.append(time.perf_counter() - t)
                rows.append(Row("tcp floor", "TCP", size, "get", lat))
    finally:
        proc.kill()
        proc.wait(10)
    return rows


# ---- our store ------------------------------------------------------------------------------

def index_app() -> Any:
    """The conductor's registry + store-index routes and report channel (what a store node
    reports to)."""
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from mooncake_server.instance.heap import freeze_startup_heap
    from mooncake_server.roles.conductor.registry import InstanceRegistry, registry_router
    from mooncake_server.roles.master.master import (
        StoreMaster,
        master_router,
        serve_index_channel,
    )

    registry = InstanceRegistry(5.0)
    master = StoreMaster(registry, 1, SECRET)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        channel = await serve_index_channel(master, "127.0.0.1", 0, "127.0.0.1", SECRET)
        freeze_startup_heap()  # as the conductor does once it serves
        try:
            yield
        finally:
            await channel.close()

    app = FastAPI(lifespan=lifespan)
    app.include_router(registry_router(registry, SECRET))
    app.include_router(master_router(master, SECRET))
    return app


def serve_index(port: int) -> None:
    """--index-server: run the index in its own process, as the conductor would."""
    import uvicorn

    from mooncake_server.instance.http_server import server_config

    uvicorn.Server(server_config(index_app(), host="127.0.0.1", port=port,
                                 log_level="warning")).run()


class IndexProcess:
    """The store index served from a separate process, so its work does not share this
    process's GIL with the client being measured."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "--index-server", str(self.port)],
                                     start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("index server did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def bench_ours(iters: int) -> tuple[list[Row], dict[str, float]]:
    import httpx

    from mooncake_server.instance.heap import freeze_startup_heap
    from mooncake_server.roles.conductor.registry import InstanceRegistry
    from mooncake_server.roles.master.master import StoreMaster
    from mooncake_server.store_client.client import StoreClient
    from mooncake_server.store_client.cluster import StoreCluster
    from mooncake_server.transfer import TransferEngine, crc32c
    from mooncake_server.wire.auth import secret_headers
    from mooncake_server.wire.instances import StoreLocation

    index = IndexProcess()
    port = free_port()
    env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": SECRET}
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_server", "--role", "store",
                             "--port", str(port), "--conductor-url", index.url,
                             "--instance-id", "bench-store", "--memory", "1200MiB",
                             "--log-level", "warning"], env=env, start_new_session=True)
    rows: list[Row] = []
    extra: dict[str, float] = {}
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    r = await http.get(f"http://127.0.0.1:{port}/health")
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("store node did not start")
                await asyncio.sleep(0.05)
            loc = StoreLocation.model_validate(
                {k: v for k, v in r.json().items() if k in StoreLocation.model_fields})
            freeze_startup_heap()  # as every role does once it serves (mooncake_server/instance/heap.py)
            for transport in ("shm", "tcp"):
                engine = TransferEngine(secret=SECRET.encode(), serve=False, transport=transport)
                try:
                    client = StoreClient(loc, engine, http, SECRET)
                    cluster = StoreCluster(index.url, engine, http, SECRET)
                    for size in SIZES:
                        n = iters_for(size, iters)
                        src = engine.alloc_shared(f"src-{size}", BATCH * size)
                        src[:] = os.urandom(BATCH * size)
                        dst = engine.alloc_shared(f"dst-{size}", BATCH * size)
                        sa, da = addr_of(src), addr_of(dst)
                        sums = [crc32c(sa + i * size, size) for i in range(BATCH)]
                        path = "same host (shm)" if transport == "shm" else "TCP"
                        put_lat, get_lat, bget_lat, cget_lat, copy_lat = [], [], [], [], []
                        for it in range(n):
                            keys = [f"{transport}-{size}-{it}-{i}" for i in range(BATCH)]
                            await client.put(keys[1:], [sa + i * size for i in range(1, BATCH)],
                                             [size] * (BATCH - 1), sums[1:])
                            # put, then get of that key: the pattern of the Redis baseline
                            t = time.perf_counter()
                            ok = await client.put(keys[:1], [sa], [size], sums[:1])
                            put_lat.append(time.perf_counter() - t)
                            assert ok == [True]
                            t = time.perf_counter()
                            got = await client.get(keys[:1], [da], [size])
                            get_lat.append(time.perf_counter() - t)
                            t = time.perf_counter()
                            got += await client.get(keys, [da + i * size for i in range(BATCH)],
                                                    [size] * BATCH)
                            bget_lat.append(time.perf_counter() - t)
                            if transport == "shm":
                                # The baseline beside it, in the same conditions: memcpy of the
                                # same 16 values between two buffers of this process.
                                t = time.perf_counter()
                                for i in range(BATCH):
                                    ctypes.memmove(da + i * size, sa + i * size, size)
                                copy_lat.append(time.perf_counter() - t)
                            t = time.perf_counter()
                            got += await cluster.get(keys[:1], [da], [size])
                            cget_lat.append(time.perf_counter() - t)
                            assert got == 2 + BATCH, got
                            await client.remove(keys)
                        assert bytes(dst) == bytes(src)
                        rows += [Row("ours", path, size, "put", put_lat),
                                 Row("ours", path, size, "get", get_lat),
                                 Row("ours", path, size, f"get x{BATCH}", bget_lat, BATCH),
                                 Row("ours", path, size, "get via index", cget_lat)]
                        if copy_lat:
                            rows.append(Row("memcpy", "beside the gets", size, f"copy x{BATCH}",
                                            copy_lat, BATCH))
                        engine.unregister_memory(f"src-{size}")
                        engine.unregister_memory(f"dst-{size}")
                finally:
                    engine.close()
            # Batched exists of 256 keys: over HTTP to the node, and the index's prefix query.
            keys = [f"{i:032x}" for i in range(256)]
            client_lat, index_lat, http_lat = [], [], []
            master = StoreMaster(InstanceRegistry(5.0), 1, SECRET)
            body = json.dumps({"keys": keys})
            headers = {**secret_headers(SECRET), "content-type": "application/json"}
            for _ in range(200):
                t = time.perf_counter()
                await client.prefix_hits(keys)
                client_lat.append(time.perf_counter() - t)
                t = time.perf_counter()
                r = await http.post(f"{loc.url}/store/exists", content=body, headers=headers)
                http_lat.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
                t = time.perf_counter()
                master.prefix(keys)
                index_lat.append(time.perf_counter() - t)
            extra["exists256_rpc_ms"] = statistics.median(client_lat) * 1e3
            extra["exists256_http_ms"] = statistics.median(http_lat) * 1e3
            extra["exists256_index_ms"] = statistics.median(index_lat) * 1e3
    finally:
        proc.terminate()
        proc.wait(10)
        index.stop()
    return rows, extra


# ---- Redis ----------------------------------------------------------------------------------

def bench_redis(iters: int) -> list[Row] | str:
    server = shutil.which("redis-server")
    if server is None:
        return "redis-server not installed (apt-get install redis-server)"
    try:
        import redis
    except ImportError:
        return "redis-py not installed (pip install 'redis[hiredis]')"
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    return "redis-server did not start"
                time.sleep(0.05)
        parser = type(r.connection_pool.get_connection().
                      _parser).__name__ if hasattr(r.connection_pool, "get_connection") else "?"
        for size in SIZES:
            values = [os.urandom(size) for _ in range(BATCH)]
            put_lat, get_lat = [], []
            for it in range(iters_for(size, iters)):
                # The sequence every system runs: the other 15 values, then one put and the
                # get of that key (bandwidth spent just before the get is part of the setting).
                keys = [f"k-{size}-{it}-{i}" for i in range(BATCH)]
                for key, value in zip(keys[1:], values[1:]):  # not MSET: no 60 MiB command
                    r.set(key, value)
                t = time.perf_counter()
                r.set(keys[0], values[0])
                put_lat.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = r.get(keys[0])
                get_lat.append(time.perf_counter() - t)
                assert got == values[0]
                r.delete(*keys)
            name = "redis+hiredis" if "Hiredis" in parser else f"redis ({parser})"
            rows += [Row(name, "TCP", size, "put", put_lat),
                     Row(name, "TCP", size, "get", get_lat)]
    finally:
        proc.terminate()
        proc.wait(10)
    return rows


# ---- Mooncake Store -------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def reference_python() -> Path | None:
    """The Python of the environment holding Mooncake's wheel (`.venv-mooncake-ref`, made by
    scripts/setup.sh --test, or MOONCAKE_REF_PYTHON); it owns the `mooncake` package, so it is
    not the one running this script."""
    path = Path(os.environ.get("MOONCAKE_REF_PYTHON", ROOT / ".venv-mooncake-ref/bin/python"))
    return path if path.exists() else None


def bench_mooncake(iters: int) -> list[Row] | str:
    python = reference_python()
    if python is None:
        return "Mooncake's wheel not installed (.venv-mooncake-ref: scripts/setup.sh --test)"
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "needs root and unshare(1): Mooncake binds wildcard addresses, so it runs in a " \
               "private network namespace"
    master = python.parent / "mooncake_master"
    out = Path(tempfile.mkdtemp()) / "mooncake.json"
    script = (f"ip link set lo up && exec {python} {__file__} --mooncake-worker "
              f"--iters {iters} --out {out} --master-bin {master}")
    run = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True,
                         check=False,
                         timeout=600)
    if not out.exists():
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        return "Mooncake run failed: " + " | ".join(tail)
    data = json.loads(out.read_text())
    return [Row(**{k: v for k, v in row.items() if k != "client_copies"}) for row in data]


def bench_api(iters: int) -> tuple[list[Row], list[str]]:
    """Our Mooncake API (`mooncake_server.mooncake_api`): a pure client in this process, a
    `--role master` and a `--role store` process, TCP."""
    from mooncake_bench.mooncake_calls import measure
    from mooncake_testkit.role_procs import RoleProc

    env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": SECRET}
    mport, sport = free_port(), free_port()
    master = RoleProc("master", "master", "127.0.0.1", mport, [
        sys.executable, "-m", "mooncake_server", "--role", "master", "--port", str(mport),
        "--log-level", "warning"], env)
    node = RoleProc("store", "store-api", "127.0.0.1", sport, [
        sys.executable, "-m", "mooncake_server", "--role", "store", "--port", str(sport),
        "--master", f"127.0.0.1:{mport}", "--memory", "2GiB", "--transport", "tcp",
        "--log-level", "warning"], env)
    try:
        master.start().wait_healthy(60)
        node.start().wait_healthy(60)
        deadline = time.monotonic() + 30
        while httpx_get_json(master.url + "/health").get("stores", 0) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the store node never registered with the master")
            time.sleep(0.05)
        os.environ["MOONCAKE_CLUSTER_SECRET"] = SECRET
        data = measure("mooncake_server.mooncake_api", f"127.0.0.1:{mport}", "ours", iters)
    finally:
        node.kill()
        master.kill()
    notes = [f"ours API, {human(r['size'])}: {r['client_copies']} bytes copied through the "
             f"client's own buffers during {r['op']} (zero-copy: 0)" for r in data
             if r["op"].startswith("batch_get_into")]
    return [Row(**{k: v for k, v in r.items() if k != "client_copies"}) for r in data], notes


def httpx_get_json(url: str) -> dict[str, Any]:
    """GET a JSON body, {} if the server does not answer yet."""
    import httpx

    try:
        return dict(httpx.get(url, timeout=2).json())
    except (httpx.HTTPError, ValueError):
        return {}


def mooncake_worker(iters: int, out: Path, master_bin: str) -> None:
    """Inside the namespace: master + holder process + this client."""
    rpc = free_port()
    master = subprocess.Popen([master_bin, "--rpc_port", str(rpc), "--rpc_address", "127.0.0.1",
                               "--metrics_port", str(free_port())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = subprocess.Popen([sys.executable, __file__, "--mooncake-holder", str(rpc)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()  # "ready" once its segment is mounted
        if "ready" not in line:
            raise RuntimeError(f"holder failed: {line!r}")
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        # No global segment: every value lives in the holder, so bytes cross a socket.
        rc = store.setup(f"127.0.0.1:{free_port()}", "P2PHANDSHAKE", 0, 512 << 20, "tcp", "",
                         f"127.0.0.1:{rpc}")
        if rc != 0:
            raise RuntimeError(f"client setup returned {rc}")
        rows = []
        for size in SIZES:
            src = ctypes.create_string_buffer(BATCH * size)
            dst = ctypes.create_string_buffer(BATCH * size)
            ctypes.memmove(src, os.urandom(BATCH * size), BATCH * size)
            sa, da = ctypes.addressof(src), ctypes.addressof(dst)
            store.register_buffer(sa, BATCH * size)
            store.register_buffer(da, BATCH * size)
            put_lat, get_lat, bget_lat = [], [], []
            for it in range(iters_for(size, iters)):
                keys = [f"mc-{size}-{it}-{i}" for i in range(BATCH)]
                store.batch_put_from(keys[1:], [sa + i * size for i in range(1, BATCH)],
                                     [size] * (BATCH - 1))
                t = time.perf_counter()  # put, then get of that key, as for the others
                rc = store.put_from(keys[0], sa, size)
                put_lat.append(time.perf_counter() - t)
                if rc != 0:
                    raise RuntimeError(f"put_from returned {rc}")
                t = time.perf_counter()
                got = store.batch_get_into(keys[:1], [da], [size])
                get_lat.append(time.perf_counter() - t)
                t = time.perf_counter()
                got += store.batch_get_into(keys, [da + i * size for i in range(BATCH)],
                                            [size] * BATCH)
                bget_lat.append(time.perf_counter() - t)
                if any(g != size for g in got):
                    raise RuntimeError(f"batch_get_into returned {got}")
                store.batch_remove(keys) if hasattr(store, "batch_remove") else None
            if dst.raw != src.raw:
                raise RuntimeError("Mooncake returned different bytes")
            store.unregister_buffer(sa)
            store.unregister_buffer(da)
            for op, lat, per in (("put", put_lat, 1), ("get", get_lat, 1),
                                 (f"get x{BATCH}", bget_lat, BATCH)):
                rows.append({"system": "mooncake", "path": "TCP (remote holder)", "size": size,
                             "op": op, "lat": lat, "per_call": per})
        store.close()
        # The API path: batch_put_from / batch_get_into x16, timed as for ours (bench_api).
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mooncake_bench"))
        import mooncake_calls

        rows += mooncake_calls.measure("mooncake.store", f"127.0.0.1:{rpc}", "mooncake", iters)
        out.write_text(json.dumps(rows))
    finally:
        holder.kill()
        master.kill()


def mooncake_holder(rpc: int) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(f"127.0.0.1:{free_port()}", "P2PHANDSHAKE", 1536 << 20, 16 << 20, "tcp", "",
                     f"127.0.0.1:{rpc}")
    print("ready" if rc == 0 else f"setup returned {rc}", flush=True)
    time.sleep(3600)


# ---- report ---------------------------------------------------------------------------------

def find(rows: list[Row], system: str, path: str, size: int, op: str) -> Row | None:
    return next((r for r in rows if r.system.startswith(system) and r.path.startswith(path)
                 and r.size == size and r.op == op), None)


def report(rows: list[Row], extra: dict[str, float], notes: list[str]) -> None:
    print(f"\n{'system':<18}{'path':<21}{'size':>8}  {'op':<14}{'GB/s':>7}{'ops/s':>9}"
          f"{'p50 ms':>9}{'p99 ms':>9}")
    for r in rows:
        print(f"{r.system:<18}{r.path:<21}{human(r.size):>8}  {r.op:<14}{r.gbps:>7.2f}"
              f"{r.ops:>9.0f}{r.pct(0.5):>9.3f}{r.pct(0.99):>9.3f}")
    print("\nratios (throughput, same run; targets at >= 1 MiB in brackets):")
    for size in SIZES:
        tcp = find(rows, "ours", "TCP", size, "get")
        tcpb = find(rows, "ours", "TCP", size, f"get x{BATCH}")
        shm = find(rows, "ours", "same host", size, "get")
        shmb = find(rows, "ours", "same host", size, f"get x{BATCH}")
        memcpy = find(rows, "memcpy", "", size, "copy")
        memcpyb = (find(rows, "memcpy", "beside", size, f"copy x{BATCH}")
                   or find(rows, "memcpy", "", size, f"copy x{BATCH}"))
        redis = find(rows, "redis", "", size, "get")
        floor = find(rows, "tcp floor", "", size, "get")
        mc = find(rows, "mooncake", "", size, "get")
        mcb = find(rows, "mooncake", "", size, f"get x{BATCH}")
        line: list[str] = []
        if tcp and redis:
            line.append(f"TCP get / Redis GET {tcp.gbps / redis.gbps:.2f}x [>=2]")
        if floor and redis:
            line.append(f"TCP floor / Redis GET {floor.gbps / redis.gbps:.2f}x")
        if tcp and floor:
            line.append(f"TCP get / TCP floor {tcp.gbps / floor.gbps:.2f}x")
        if tcp and mc:
            line.append(f"TCP get / Mooncake get {tcp.gbps / mc.gbps:.2f}x")
        if tcpb and mcb:
            line.append(f"TCP get x{BATCH} / Mooncake batch_get_into x{BATCH} "
                        f"{tcpb.gbps / mcb.gbps:.2f}x [>=1.5]")
        if shm and memcpy:
            line.append(f"shm get / memcpy {shm.gbps / memcpy.gbps:.2f}x")
        for op in (f"batch_put_from x{BATCH}", f"batch_get_into x{BATCH}"):
            ours_api = find(rows, "ours", "TCP (API)", size, op)
            their_api = find(rows, "mooncake", "TCP (API)", size, op)
            if ours_api and their_api:
                line.append(f"API {op} / Mooncake's {ours_api.gbps / their_api.gbps:.2f}x "
                            "[>=1.0]")
        if shmb and memcpyb:
            line.append(f"shm get x{BATCH} / memcpy x{BATCH} {shmb.gbps / memcpyb.gbps:.2f}x "
                        "[>=0.8]")
        print(f"  {human(size):>7}: " + "; ".join(line))
    if extra:
        print(f"\nbatched exists of 256 keys, p50: {extra['exists256_rpc_ms']:.3f} ms on the node's "
              f"control channel, round trip included [< 1 ms]; {extra['exists256_http_ms']:.3f} "
              f"ms as HTTP POST /store/exists; {extra['exists256_index_ms']:.3f} ms inside the "
              "global index")
    for note in notes:
        print(f"note: {note}")


def run_loop(coro: Any) -> Any:
    """Run on uvloop when installed, as the roles do (uvicorn picks it), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40, help="calls per size and op (capped by size)")
    p.add_argument("--skip-redis", action="store_true")
    p.add_argument("--skip-mooncake", action="store_true")
    p.add_argument("--skip-api", action="store_true",
                   help="skip the Mooncake-API path (ours and the real wheel's)")
    p.add_argument("--mooncake-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mooncake-holder", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--master-bin", default="mooncake_master", help=argparse.SUPPRESS)
    p.add_argument("--index-server", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--floor-server", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.index_server is not None:
        serve_index(args.index_server)
        return
    if args.floor_server is not None:
        serve_floor(args.floor_server)
        return
    if args.mooncake_holder is not None:
        mooncake_holder(args.mooncake_holder)
        return
    if args.mooncake_worker:
        mooncake_worker(args.iters, args.out, args.master_bin)
        return
    notes: list[str] = []
    rows = bench_memcpy(args.iters) + bench_tcp_floor(args.iters)
    ours, extra = run_loop(bench_ours(args.iters))
    rows += ours
    if not args.skip_api:
        api_rows, api_notes = bench_api(args.iters)
        rows += api_rows
        notes += api_notes
    for name, skip, fn in (("Redis", args.skip_redis, bench_redis),
                           ("Mooncake Store", args.skip_mooncake, bench_mooncake)):
        if skip:
            continue
        got = fn(args.iters)
        if isinstance(got, str):
            notes.append(f"{name} skipped: {got}")
        else:
            rows += got
    report(rows, extra, notes)


if __name__ == "__main__":
    main()
