#!/usr/bin/env python
"""Drive LMCache 0.5.6's own `mooncakestore://` remote connector against whatever
`mooncake.store` resolves to, on the CPU.

Nothing in LMCache or in `mooncake.store` is stubbed or patched: the harness builds LMCache's
real LMCacheEngineConfig and LMCacheMetadata, a real LocalCPUBackend (its own CPU allocator;
LMCache's CPU device ops stand in for pinned memory where there is no CUDA), creates the
connector through LMCache's CreateConnector (URL -> MooncakestoreConnectorAdapter ->
MooncakestoreConnector, wrapped in InstrumentedRemoteConnector, as RemoteBackend does), and
then calls the connector's public API. Every check prints one PASS/FAIL line, then
"N passed, M failed"; the exit status is the number of FAILs.

Scenarios (each its own connector, i.e. its own MooncakeDistributedStore):
  meta      save_chunk_meta=True (LMCache's default): put_parts of header + KV bytes,
            batch_get_buffer, the header rebuilds each MemoryObj
  zerocopy  save_chunk_meta=False: put_from / batch_put_from straight from the backend's
            registered buffer, batch_get_into straight into newly allocated MemoryObjs

Usage:
  python lmcache_harness.py --master 127.0.0.1:50051 --metadata P2PHANDSHAKE \
      --segment-size 67108864 [--scenarios meta,zerocopy]
"""

import argparse
import asyncio
import logging
import os
import sys
import time
import traceback
import uuid

RESULTS: list[tuple[bool, str]] = []
LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 32, 16


def report(ok, name, detail=""):
    """Record and print one PASS/FAIL line."""
    RESULTS.append((bool(ok), name))
    print(f"{'PASS' if ok else 'FAIL'}: {name}" + (f" -- {detail}" if detail else ""), flush=True)
    return bool(ok)


def check(name, fn):
    """Run fn(); PASS if it returns truthy (or (truthy, detail)), FAIL on falsy or exception."""
    try:
        res = fn()
        detail = ""
        if isinstance(res, tuple):
            res, detail = res
        return report(res, name, detail)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return report(False, name, f"{type(exc).__name__}: {exc}")


def parse_args():
    """Command line: where the master is and how the connector's store is set up."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master", default="127.0.0.1:50051", help="master_server_address")
    p.add_argument("--metadata", default="P2PHANDSHAKE", help="metadata_server")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--local-hostname", default="127.0.0.1")
    p.add_argument("--segment-size", type=int, default=64 << 20, help="global_segment_size")
    p.add_argument("--buffer-size", type=int, default=16 << 20, help="local_buffer_size")
    p.add_argument("--scenarios", default="meta,zerocopy")
    p.add_argument("--chunks", type=int, default=4, help="KV chunks written per scenario")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args()


def build(args, save_chunk_meta):
    """LMCache's real engine config, metadata and LocalCPUBackend for a small bf16 model."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    extra = {
        # The connector forwards every mooncake_* key, prefix stripped, to store.setup().
        "mooncake_master_server_address": args.master,
        "mooncake_metadata_server": args.metadata,
        "mooncake_protocol": args.protocol,
        "mooncake_local_hostname": args.local_hostname,
        "mooncake_global_segment_size": args.segment_size,
        "mooncake_local_buffer_size": args.buffer_size,
        "save_chunk_meta": save_chunk_meta,
        # LMCache's 1 s default gives up on a put (logging only) on a busy two-core box.
        "transfer_timeout": 60,
    }
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.0625,
        remote_url=f"mooncakestore://{args.master}/", remote_serde="naive", extra_config=extra)
    metadata = LMCacheMetadata(
        model_name="harness/model", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)
    return config, metadata, LocalCPUBackend(config, metadata)


def obj_bytes(obj):
    """A copy of a MemoryObj's logical bytes (uint8)."""
    import torch

    return obj.tensor.contiguous().view(torch.uint8).flatten().clone()


def run_scenario(kind, args):
    """One connector's put / exists / get / miss / close round."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.connector.mooncakestore_connector import (
        MooncakestoreConnector,
    )

    tag = f"[{kind}]"
    zero_copy = kind == "zerocopy"
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    st = {}

    def _backend():
        st["config"], st["meta"], st["be"] = build(args, save_chunk_meta=not zero_copy)
        alloc = st["be"].memory_allocator
        return True, (f"LocalCPUBackend on {st['be'].dst_device}, {type(alloc).__name__}, "
                      f"{alloc.buffer.numel()} B; KV shapes {st['meta'].get_shapes()}")

    if not check(f"{tag} build LMCache config, metadata and LocalCPUBackend", _backend):
        return
    be, meta = st["be"], st["meta"]

    def _create():
        t0 = time.time()
        conn = CreateConnector(st["config"].remote_url, loop, be, st["config"], meta)
        st["conn"], inner = conn, conn.getWrappedConnector()
        return (isinstance(inner, MooncakestoreConnector)
                and inner.save_chunk_meta is (not zero_copy)
                and inner.registered_buffer_ptr is not None), (
            f"{type(conn).__name__}({type(inner).__name__}) via CreateConnector in "
            f"{time.time() - t0:.2f}s, save_chunk_meta={inner.save_chunk_meta}, registered "
            f"buffer={inner.registered_buffer_ptr is not None}")

    if not check(f"{tag} CreateConnector(mooncakestore://) sets up the store", _create):
        return
    conn = st["conn"]
    shapes, dtypes, fmt = meta.get_shapes(), meta.get_dtypes(), conn.getWrappedConnector().meta_fmt

    gen = torch.Generator().manual_seed(1234 + len(kind))
    salt = uuid.uuid4().int % (1 << 40)
    n = args.chunks
    keys = [CacheEngineKey("harness/model", 1, 0, salt + i, torch.bfloat16) for i in range(n)]
    missing = CacheEngineKey("harness/model", 1, 0, salt + 10_000, torch.bfloat16)
    objs, want = [], []
    for _ in range(n):
        obj = be.allocate(shapes, dtypes, fmt)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(obj.tensor.dtype))
        objs.append(obj)
        want.append(obj_bytes(obj))
    print(f"INFO: {tag} {n} chunks of {tuple(objs[0].tensor.shape)} {objs[0].tensor.dtype} "
          f"({want[0].numel()} B each), e.g. key {keys[0].to_string()}", flush=True)

    check(f"{tag} exists before put is False",
          lambda: (not any(run(conn.exists(k)) for k in keys), "exists() on all keys"))

    def _put():
        # As RemoteBackend: a reference for the connector, which drops it when the put ends.
        for o in objs:
            o.ref_count_up()
        run(conn.put(keys[0], objs[0]))  # the single-object path
        run(conn.batched_put(keys[1:], objs[1:]))
        return True, (f"put(1) + batched_put({n - 1}), "
                      f"batched_put supported={conn.support_batched_put()}")

    check(f"{tag} put and batched_put", _put)
    check(f"{tag} exists / exists_sync after put",
          lambda: (all(run(conn.exists(k)) and conn.exists_sync(k) for k in keys), f"{n} keys"))

    def _contains():
        full = run(conn.batched_async_contains("lookup-1", keys))
        cut = run(conn.batched_async_contains("lookup-2", keys[:2] + [missing] + keys[2:]))
        return full == n and cut == 2, f"all -> {full}, [hit, hit, miss, ...] -> {cut}"

    check(f"{tag} batched_async_contains counts the hit prefix", _contains)

    def _get():
        got = run(conn.batched_get(keys))
        st["got"] = got
        hits = [o is not None for o in got]
        return all(hits), f"batched_get({n}) -> {hits}"

    if check(f"{tag} batched_get of all keys", _get):
        def _cmp():
            got = st["got"]
            bad = [i for i, (o, w) in enumerate(zip(got, want)) if not torch.equal(obj_bytes(o), w)]
            meta_ok = all(o.get_shapes() == objs[0].get_shapes()
                          and o.get_dtypes() == objs[0].get_dtypes() for o in got)
            return not bad and meta_ok, (f"{n} x {want[0].numel()} B compared, mismatching: "
                                         f"{bad}; shapes/dtypes kept: {meta_ok}")

        check(f"{tag} read-back bytes bit-identical", _cmp)
        for o in st["got"]:
            o.ref_count_down()

    def _miss():
        got = run(conn.batched_get([keys[0], missing]))
        ok = got[0] is not None and got[1] is None and torch.equal(obj_bytes(got[0]), want[0])
        if got[0] is not None:
            got[0].ref_count_down()
        return ok, f"batched_get([hit, miss]) -> {[o is not None for o in got]}"

    check(f"{tag} a missing key reads back as None", _miss)

    def _partial():
        # The last chunk of a prompt is short: fewer tokens, same layout.
        half = be.allocate(meta.get_shapes(CHUNK // 2), dtypes, fmt)
        half.tensor.copy_(torch.randn(half.tensor.shape, generator=gen).to(half.tensor.dtype))
        k = CacheEngineKey("harness/model", 1, 0, salt + 20_000, torch.bfloat16)
        sent, sent_shape = obj_bytes(half), tuple(half.tensor.shape)
        run(conn.put(k, half))  # the connector drops the only reference: freed after
        got = run(conn.batched_get([k]))[0]
        shape = None if got is None else tuple(got.tensor.shape)
        ok = got is not None and shape == sent_shape and torch.equal(obj_bytes(got), sent)
        if got is not None:
            got.ref_count_down()
        return ok, f"put {sent_shape} -> got {shape}, identical={ok}"

    if zero_copy:
        def _straight():
            # Our store counts bytes it had to copy through its own buffers; a real Mooncake
            # has no such counter, so the check only applies where there is one.
            staged = getattr(conn.getWrappedConnector().store, "staged_bytes", 0)
            return staged == 0, f"bytes staged through the client's own buffers: {staged}"

        check(f"{tag} puts and gets went straight to/from the registered buffer", _straight)

    check(f"{tag} a partial chunk ({CHUNK // 2} of {CHUNK} tokens) reads back as written",
          _partial)
    for o in objs:
        o.ref_count_down()

    def _close():
        run(conn.close())
        inner = conn.getWrappedConnector()
        return inner.registered_buffer_ptr is None and inner.store.get_hostname() == "", \
            "buffer unregistered, store closed"

    check(f"{tag} close()", _close)
    loop.close()


def main():
    """Import LMCache's connector and run each scenario; exit with the number of FAILs."""
    args = parse_args()
    # LMCache reports usage to its own servers unless told not to (read when it is first
    # imported, below); this harness talks only to the store it is given.
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # LMCache logs every step at INFO through its own handlers
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    def _imp():
        t0 = time.time()
        import lmcache
        import mooncake.store as mstore
        from lmcache.v1.storage_backend.connector import mooncakestore_connector  # noqa: F401

        return True, (f"lmcache {lmcache.__version__} on {lmcache.torch_device_type} in "
                      f"{time.time() - t0:.1f}s; mooncake.store = {mstore.__file__}")

    if not check("import LMCache mooncakestore connector + mooncake.store", _imp):
        sys.exit(1)
    for kind in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        run_scenario(kind, args)

    fails = sum(1 for ok, _ in RESULTS if not ok)
    print(f"{len(RESULTS) - fails} passed, {fails} failed", flush=True)
    sys.stdout.flush()
    # Threads LMCache leaves behind (stats, telemetry) must not hold the exit.
    os._exit(min(fails, 100))


if __name__ == "__main__":
    main()
