"""Batched puts and gets through Mooncake's store API, timed the same way for any module that
provides `MooncakeDistributedStore` (the real wheel's `mooncake.store`, or
`mooncake_server.mooncake_api`). Standard library only: it also runs in the real wheel's own
environment, as a script.

    python mooncake_calls.py MODULE MASTER_ADDR OUT.json [--iters N] [--label NAME]

Per value size, each iteration: batch_put_from of 16 values from registered memory (timed),
batch_get_into of the same 16 into other registered memory (timed), bytes compared once at
the end, then the keys removed (force). A pure client (no segment of its own), so every byte
crosses to a store node.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import time
from typing import Any

SIZES = [64 << 10, 1 << 20, 4 << 20]
BATCH = 16


def iterations(size: int, iters: int) -> int:
    """Calls per size: at most 512 MiB moved per op and size, at least 8."""
    return max(8, min(iters, (512 << 20) // (size * BATCH)))


def measure(module: str, master: str, label: str, iters: int) -> list[dict[str, Any]]:
    """Rows of (system, path, size, op, latencies, values per call)."""
    store = importlib.import_module(module).MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"{module}: setup returned {rc}")
    rows: list[dict[str, Any]] = []
    try:
        for size in SIZES:
            src = ctypes.create_string_buffer(BATCH * size)
            dst = ctypes.create_string_buffer(BATCH * size)
            ctypes.memmove(src, os.urandom(BATCH * size), BATCH * size)
            sa, da = ctypes.addressof(src), ctypes.addressof(dst)
            for addr in (sa, da):
                if store.register_buffer(addr, BATCH * size) != 0:
                    raise RuntimeError("register_buffer failed")
            staged = getattr(store, "staged_bytes", None)
            put_lat, get_lat = [], []
            for it in range(iterations(size, iters)):
                keys = [f"api-{size}-{it}-{i}" for i in range(BATCH)]
                t = time.perf_counter()
                put = store.batch_put_from(keys, [sa + i * size for i in range(BATCH)],
                                           [size] * BATCH)
                put_lat.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = store.batch_get_into(keys, [da + i * size for i in range(BATCH)],
                                           [size] * BATCH)
                get_lat.append(time.perf_counter() - t)
                if any(p != 0 for p in put) or any(g != size for g in got):
                    raise RuntimeError(f"{module}: put {put}, get {got}")
                store.batch_remove(keys, force=True)
            if dst.raw != src.raw:
                raise RuntimeError(f"{module} returned different bytes")
            copied = (getattr(store, "staged_bytes", 0) - staged) if staged is not None else None
            for addr in (sa, da):
                store.unregister_buffer(addr)
            for op, lat in ((f"batch_put_from x{BATCH}", put_lat),
                            (f"batch_get_into x{BATCH}", get_lat)):
                rows.append({"system": label, "path": "TCP (API)", "size": size, "op": op,
                             "lat": lat, "per_call": BATCH, "client_copies": copied})
    finally:
        store.close()
    return rows


def main() -> None:
    """Measure and write the rows as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module")
    p.add_argument("master")
    p.add_argument("out")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--label", default="mooncake API")
    args = p.parse_args()
    rows = measure(args.module, args.master, args.label, args.iters)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
