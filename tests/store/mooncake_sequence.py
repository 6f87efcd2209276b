"""One scripted sequence of Mooncake store calls, printed as JSON: run with the real wheel's
`mooncake.store` and with ours, the two outputs must be equal.

    python mooncake_sequence.py MODULE MASTER_ADDR SEGMENT_BYTES

MODULE is `mooncake.store` (the real wheel) or `mooncake_server.mooncake_api`. Only the standard
library and MODULE are imported, so it runs in the real wheel's own environment.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import sys
from typing import Any


def run(module: str, master: str, segment: int) -> list[tuple[str, Any]]:
    """The calls and what each returned (bytes as their repr)."""
    api = importlib.import_module(module)
    store = api.MooncakeDistributedStore()
    out: list[tuple[str, Any]] = []

    def plain(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray)):
            return repr(bytes(value))
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    def call(label: str, value: Any) -> None:
        out.append((label, plain(value)))

    call("setup", store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "",
                              master))
    call("put new", store.put("seq/a", b"hello"))
    call("put again", store.put("seq/a", b"something else"))
    call("get", store.get("seq/a"))
    call("get missing", store.get("seq/missing"))
    call("put empty key", store.put("", b"x"))
    call("put empty value", store.put("seq/empty", b""))
    call("put over local buffer", store.put("seq/big", bytes(17 << 20)))
    call("is_exist", [store.is_exist("seq/a"), store.is_exist("seq/missing")])
    call("batch_is_exist", store.batch_is_exist(["seq/a", "seq/missing", "seq/a"]))
    call("get_size", [store.get_size("seq/a"), store.get_size("seq/missing")])
    call("remove after a read", store.remove("seq/a"))
    call("remove forced", store.remove("seq/a", force=True))
    call("remove missing", store.remove("seq/a"))
    call("put then remove", [store.put("seq/b", b"b"), store.remove("seq/b")])
    call("put_parts", store.put_parts("seq/p", b"ab", b"cd", b"ef"))
    call("get parts", store.get("seq/p"))
    call("put_batch", store.put_batch(["seq/x1", "seq/x2"], [b"one", b"two"]))
    call("get_batch", [repr(v) for v in store.get_batch(["seq/x1", "seq/missing", "seq/x2"])])
    call("upsert", [store.upsert("seq/x1", b"ONE!"), store.get("seq/x1")])
    zero = api.ReplicateConfig()
    zero.replica_num = 0
    call("replica_num 0", store.put("seq/r0", b"x", zero))
    pins = api.ReplicateConfig()
    call("pin defaults", [pins.soft_pin_action.name, pins.soft_pin_ttl_ms, pins.with_hard_pin,
                          sorted(api.SoftPinAction.__members__)])
    pins.soft_pin_action = api.SoftPinAction.ENABLE
    pins.soft_pin_ttl_ms = 60_000
    call("soft-pinned put", [store.put("seq/soft", b"s", pins), store.get("seq/soft")])
    pins.with_hard_pin = True
    call("hard-pinned put", [store.put("seq/hard", b"h", pins), store.get("seq/hard"),
                             store.remove("seq/hard", force=True)])
    two = api.ReplicateConfig()
    two.replica_num = 2
    call("replica_num 2, one node", [store.put("seq/r2", b"two", two), store.get("seq/r2")])

    size = 1 << 20
    src = ctypes.create_string_buffer(bytes(range(256)) * (4 * size // 256))
    dst = ctypes.create_string_buffer(4 * size)
    sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
    call("register", [store.register_buffer(sp, 4 * size), store.register_buffer(dp, 4 * size)])
    call("register overlap", store.register_buffer(sp + 4096, 4096))
    call("batch_put_from", store.batch_put_from(["seq/f1", "seq/f2"], [sp, sp + size],
                                                [size, 1000]))
    call("batch_put_from again", store.batch_put_from(["seq/f1", "seq/f3"], [sp + 7, sp + 2 * size],
                                                      [size, 300]))
    call("batch_put_from length mismatch", store.batch_put_from(["seq/f9"], [sp, sp], [1, 2]))
    call("batch_get_into", store.batch_get_into(
        ["seq/f2", "seq/f1", "seq/missing", "seq/f3"], [dp, dp + size, dp + 2 * size,
                                                         dp + 3 * size], [size] * 4))
    call("bytes arrived", [dst.raw[:1000] == src.raw[size:size + 1000],
                           dst.raw[size:2 * size] == src.raw[:size],
                           dst.raw[3 * size:3 * size + 300] == src.raw[2 * size:2 * size + 300]])
    call("get_into too small", store.get_into("seq/f1", dp, size - 1))
    call("get_into", store.get_into("seq/f2", dp, size))
    call("multi put", store.batch_put_from_multi_buffers(
        ["seq/m1", "seq/m2"], [[sp, sp + 5000], [sp + 9000]], [[100, 50], [300]]))
    call("multi get", store.batch_get_into_multi_buffers(
        ["seq/m1", "seq/m2", "seq/missing"], [[dp, dp + 1000], [dp + 2000], [dp + 3000]],
        [[120, 30], [300], [10]]))
    call("multi bytes", dst.raw[:120] + dst.raw[1000:1030] == src.raw[:100] +
         src.raw[5000:5050])
    call("multi too small", store.batch_get_into_multi_buffers(["seq/m1"], [[dp, dp + 500]],
                                                               [[100, 10]]))
    call("multi too large", store.batch_get_into_multi_buffers(["seq/m1"], [[dp, dp + 500]],
                                                               [[150, 10]]))
    call("unregister", [store.unregister_buffer(dp), store.unregister_buffer(dp)])
    call("regex", [store.put_batch(["seq/rx-1", "seq/rx-2"], [b"1", b"2"]),
                   store.remove_by_regex("^seq/rx-"), store.remove_by_regex("^seq/rx-")])
    call("bad regex", store.remove_by_regex("("))
    call("batch_remove", store.batch_remove(["seq/x2", "seq/missing", "seq/p"]))
    call("batch_remove forced", store.batch_remove(["seq/x2", "seq/p"], force=True))
    call("remove_all, reads leased", store.remove_all())
    call("remove_all forced", store.remove_all(force=True))
    call("after remove_all", [store.is_exist("seq/f1"), store.get("seq/f1")])
    call("health_check", store.health_check())
    call("close", store.close())
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
