"""Mooncake's store API (`mooncake_server.mooncake_api`) against a real standalone master and
store node processes: the return codes Mooncake's clients see, zero-copy reads, leases, the
mounted segment, and what bad input and faults leave behind."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator

import httpx
import pytest
from mooncake_rig import StoreOnly, store_only

from mooncake_server.mooncake_api import ReplicateConfig, SoftPinAction
from mooncake_server.roles.conductor.master_link import RemoteMaster

MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreOnly]:
    with store_only(2, "64MiB") as c:
        yield c


def buffer(size: int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    buf = ctypes.create_string_buffer(size)
    return buf, ctypes.addressof(buf)


def test_calls_answer_with_mooncakes_codes(cluster: StoreOnly) -> None:
    store = cluster.client()
    try:
        assert store.put("codes/a", b"hello") == 0
        assert store.put("codes/a", b"other bytes") == 0  # write-once: the first value stays
        assert store.get("codes/a") == b"hello"
        assert store.get("codes/missing") == b""
        assert store.put("", b"x") == -600 and store.put("codes/empty", b"") == -600
        assert store.batch_is_exist(["codes/a", "codes/missing"]) == [1, 0]
        assert (store.get_size("codes/a"), store.get_size("codes/missing")) == (5, -704)
        assert store.remove("codes/a") == -706  # the reads above hold a lease
        assert store.remove("codes/a", force=True) == 0
        assert (store.remove("codes/a"), store.is_exist("codes/a")) == (-704, 0)
        assert store.put("codes/fresh", b"x") == 0 and store.remove("codes/fresh") == 0
        assert store.put_parts("codes/parts", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
        assert store.get("codes/parts") == b"abcdef"
        assert store.upsert("codes/parts", b"replaced") == 0
        assert store.get("codes/parts") == b"replaced"
        handle = store.get_buffer("codes/parts")
        assert handle is not None and (handle.size(), bytes(handle)) == (8, b"replaced")
        assert ctypes.string_at(handle.ptr(), 8) == b"replaced"
        assert store.get_buffer("codes/missing") is None
        assert store.put("codes/big", bytes(17 * MiB)) == -600  # over local_buffer_size
        zero = ReplicateConfig()
        zero.replica_num = 0
        assert store.put("codes/r0", b"x", zero) == -600
        assert store.get_hostname().startswith("127.0.0.1")
        assert store.health_check() == 0
    finally:
        assert store.close() == 0
    assert store.health_check() == 1 and store.put("codes/closed", b"x") == -1010


def test_batch_reads_land_in_registered_memory_bit_identical_with_no_copy(
        cluster: StoreOnly) -> None:
    store = cluster.client()
    n, size = 16, MiB
    src, sp = buffer(n * size)
    dst, dp = buffer(n * size)
    ctypes.memmove(sp, os.urandom(n * size), n * size)
    keys = [f"zc/{i}" for i in range(n)]
    try:
        assert store.register_buffer(sp, n * size) == 0
        assert store.register_buffer(dp, n * size) == 0
        assert store.register_buffer(sp + 4096, 4096) == -600  # overlaps a registered one
        staged = store.staged_bytes
        assert store.batch_put_from(keys, [sp + i * size for i in range(n)], [size] * n) == \
            [0] * n
        got = store.batch_get_into(keys[::-1] + ["zc/missing"],
                                   [dp + i * size for i in range(n)] + [dp], [size] * n + [10])
        assert got == [size] * n + [-704]
        for i in range(n):
            want = zlib.crc32(src.raw[(n - 1 - i) * size:(n - i) * size])
            assert zlib.crc32(dst.raw[i * size:(i + 1) * size]) == want
        # The zero-copy calls moved 32 MiB without one byte through the client's own buffers.
        assert store.staged_bytes == staged
        assert store.get_into(keys[0], dp, size - 1) == -600  # too small: nothing read
        assert store.get("zc/0") == src.raw[:size]
        assert store.staged_bytes == staged + size  # get(bytes) copies once
    finally:
        store.remove_all(force=True)
        store.close()


def test_pointers_outside_registered_memory_are_refused_and_never_written(
        cluster: StoreOnly) -> None:
    store = cluster.client()
    reg, rp = buffer(4096)
    loose, lp = buffer(4096)
    try:
        assert store.register_buffer(rp, 4096) == 0
        assert store.put("ptr/k", b"v" * 100) == 0
        assert store.get_into("ptr/k", lp, 4096) == -600
        assert store.batch_get_into(["ptr/k"], [rp + 4000], [4096]) == [-600]  # runs past it
        assert loose.raw == bytes(4096) and reg.raw == bytes(4096)
        assert store.put_from("ptr/x", lp, 16) == -600 and store.is_exist("ptr/x") == 0
        assert store.get_into("ptr/k", rp, 4096) == 100 and reg.raw[:100] == b"v" * 100
        assert store.unregister_buffer(rp) == 0 and store.unregister_buffer(rp) == -600
        assert store.get_into("ptr/k", rp, 4096) == -600
    finally:
        store.remove_all(force=True)
        store.close()


def test_multi_buffer_pages_gather_and_scatter_in_order(cluster: StoreOnly) -> None:
    store = cluster.client()
    src, sp = buffer(64 * 1024)
    dst, dp = buffer(64 * 1024)
    ctypes.memmove(sp, os.urandom(64 * 1024), 64 * 1024)
    try:
        store.register_buffer(sp, 64 * 1024)
        store.register_buffer(dp, 64 * 1024)
        # A KV page as SGLang writes it: its K part and its V part from two pools.
        assert store.batch_put_from_multi_buffers(
            ["mb/page0", "mb/page1"], [[sp, sp + 32768], [sp + 8192]],
            [[4096, 4096], [2048]]) == [0, 0]
        assert store.get_size("mb/page0") == 8192
        assert store.batch_get_into_multi_buffers(
            ["mb/page0", "mb/page1", "mb/missing"], [[dp, dp + 16384], [dp + 30000], [dp]],
            [[1000, 7192], [2048], [10]]) == [8192, 2048, -704]
        want = src.raw[:4096] + src.raw[32768:36864]
        assert dst.raw[:1000] + dst.raw[16384:16384 + 7192] == want
        assert dst.raw[30000:32048] == src.raw[8192:10240]
        # Several buffers must add up to the object: too little room -600, too much -800.
        assert store.batch_get_into_multi_buffers(["mb/page0"], [[dp, dp + 9000]],
                                                  [[100, 10]]) == [-600]
        assert store.batch_get_into_multi_buffers(["mb/page0"], [[dp, dp + 9000]],
                                                  [[8192, 10]]) == [-800]
    finally:
        store.remove_all(force=True)
        store.close()


def test_removes_respect_read_leases_unless_forced(cluster: StoreOnly) -> None:
    store = cluster.client()
    try:
        assert store.put_batch(["rm/a-1", "rm/a-2", "rm/b", "rm/c"], [b"1", b"2", b"3", b"4"]) \
            == 0
        assert store.remove_by_regex("^rm/a-") == 2
        assert store.remove_by_regex("(") == -600
        assert store.get("rm/b") == b"3"  # leased now, for every client
        other = cluster.client()
        try:
            assert other.batch_remove(["rm/b", "rm/c", "rm/none"]) == [-706, 0, -704]
        finally:
            other.close()
        assert store.remove_all() == 0 and store.is_exist("rm/b") == 1
        assert store.remove_all(force=True) >= 1 and store.is_exist("rm/b") == 0
    finally:
        store.close()


def test_a_lease_ends_after_the_masters_lease_time() -> None:
    with store_only(1, "16MiB", "--default-kv-lease-ttl", "300") as c:
        store = c.client()
        try:
            assert store.put("ttl/k", b"x") == 0 and store.get("ttl/k") == b"x"
            assert store.remove("ttl/k") == -706
            c.wait(lambda: store.remove("ttl/k") == 0, "lease ended", timeout_s=5.0)
        finally:
            store.close()


def test_a_mounted_segment_serves_others_and_leaves_with_its_client(cluster: StoreOnly) -> None:
    owner = cluster.client(segment=32 * MiB)
    reader = cluster.client()
    try:
        here = ReplicateConfig()
        here.preferred_segment = owner.get_hostname()
        assert owner.put("mount/k", b"M" * 1000, here) == 0
        assert reader.get("mount/k") == b"M" * 1000
        where = asyncio.run(_locate(cluster, "mount/k"))
        assert owner.get_hostname() in where
    finally:
        assert owner.close() == 0
    try:
        assert reader.is_exist("mount/k") == 0 and reader.get("mount/k") == b""
    finally:
        reader.close()


async def _locate(cluster: StoreOnly, key: str) -> list[str]:
    master = RemoteMaster(f"http://{cluster.master_addr}", cluster.secret)
    try:
        reply = await master.locate([key])
        return [r.node_id for r in reply.replicas[0]]
    finally:
        await master.aclose()


def test_a_client_or_caller_without_the_secret_is_refused(cluster: StoreOnly) -> None:
    os.environ["MOONCAKE_CLUSTER_SECRET"] = "not-the-secret"
    from mooncake_server.mooncake_api import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, MiB, "tcp", "",
                       cluster.master_addr) == -600
    assert store.health_check() == 1
    node = next(iter(cluster.nodes.values()))
    assert httpx.post(node.url + "/store/exists", json={"keys": []}).status_code in (401, 403)
    assert httpx.post(cluster.master.url + "/internal/store/locate",  # type: ignore[union-attr]
                      json={"keys": []}).status_code in (401, 403)


def test_a_value_larger_than_the_pool_is_refused_and_nothing_is_held(
        cluster: StoreOnly) -> None:
    store = cluster.client()
    big, bp = buffer(80 * MiB)
    try:
        store.register_buffer(bp, 80 * MiB)
        assert store.put_from("huge/k", bp, 80 * MiB) == -200
        assert store.is_exist("huge/k") == 0
        for node in cluster.nodes.values():
            assert cluster.metric(node, "mooncake_store_writing_objects") == 0
            assert cluster.metric(node, 'mooncake_store_bytes{tier="dram"}') == 0
    finally:
        store.close()


def test_reads_survive_a_killed_node_with_two_replicas() -> None:
    with store_only(2, "32MiB") as c:
        store = c.client()
        try:
            two = ReplicateConfig()
            two.replica_num = 2
            values = {f"rep/{i}": os.urandom(64 * 1024) for i in range(8)}
            assert store.put_batch(list(values), list(values.values()), two) == 0
            c.nodes["store-0"].kill()
            assert store.get_batch(list(values)) == list(values.values())
        finally:
            store.close()


def test_a_writer_killed_mid_put_loses_its_reservations(cluster: StoreOnly) -> None:
    # The child reserves space on a node (put_start, as batch_put_from's first step) and
    # never writes; SIGKILL ends its connection, and the node frees what it held.
    child = textwrap.dedent(f"""
        import asyncio, sys, httpx
        from mooncake_server.store_client.cluster import StoreCluster
        from mooncake_server.transfer import TransferEngine

        async def main():
            engine = TransferEngine(secret=b"{cluster.secret}", serve=False)
            async with httpx.AsyncClient() as http:
                c = StoreCluster("http://{cluster.master_addr}", engine, http, "{cluster.secret}")
                place = await c.place(["kill/a", "kill/b"])
                for node, loc in place.nodes.items():
                    await c.client(loc).reserve(["kill/a", "kill/b"], [1 << 20, 1 << 20])
                print("reserved", flush=True)
                await asyncio.sleep(600)

        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reserved"
        writing = lambda: sum(cluster.metric(n, "mooncake_store_writing_objects")  # noqa: E731
                              for n in cluster.nodes.values())
        assert writing() >= 2  # both keys, on every node the master named
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        cluster.wait(lambda: writing() == 0, "reservations freed", timeout_s=10.0)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_pinned_values_outlive_a_flood_that_evicts_unpinned_ones() -> None:
    with store_only(1, "8MiB") as c:
        store = c.client()
        try:
            soft, hard = ReplicateConfig(), ReplicateConfig()
            soft.soft_pin_action = SoftPinAction.ENABLE
            soft.soft_pin_ttl_ms = 600_000
            hard.with_hard_pin = True
            kept = {"pin/soft": os.urandom(MiB), "pin/hard": os.urandom(MiB)}
            assert store.put("pin/soft", kept["pin/soft"], soft) == 0
            assert store.put("pin/hard", kept["pin/hard"], hard) == 0
            assert store.put("plain/0", os.urandom(MiB)) == 0
            for i in range(1, 12):  # 11 MiB more into an 8 MiB pool: eviction runs
                assert store.put(f"plain/{i}", os.urandom(MiB)) == 0
            c.wait(lambda: store.is_exist("plain/0") == 0, "the oldest unpinned value evicted")
            assert {k: store.get(k) for k in kept} == kept
            node = c.nodes["store-0"]
            assert c.metric(node, "mooncake_store_evictions_total") >= 4
        finally:
            store.close()
