"""A transfer-engine process for the network-namespace tests, run with `ip netns exec NS python
netns_agent.py serve|client ...`. It speaks JSON lines: one per command on stdin, one per answer
on stdout.

serve HOST: a TransferEngine listening on HOST with a seeded 32 MiB shared segment 'kv'; prints
    {"address", "pid"} and serves until stdin closes.
client: a TransferEngine (TCP forced, 2 s timeout) taking commands:
    {"cmd": "open", "peer"}                      -> {"handle"}
    {"cmd": "submit", "handle", "op", "off", "n", "count", "pos"} -> {"batch"}: `count`
        requests of n bytes, local memory from `pos` on, all at remote offset `off`
    {"cmd": "wait", "batch"}                     -> {"ok", "error", "elapsed"}
    {"cmd": "crc", "pos", "n"}                   -> {"crc"} of local memory
    {"cmd": "fill", "pos", "n", "seed"}          -> {"crc"} after filling local memory
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import time
from typing import Any

from mooncake_server.transfer import Op, TransferEngine, TransferError, TransferRequest, crc32c

SECRET = b"netns-test-secret"
SEG_BYTES = 32 << 20
SEED = 4321
TIMEOUT_S = 2.0


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(host: str) -> None:
    """Serve a seeded segment until stdin closes."""
    with TransferEngine(secret=SECRET, listen_host=host, timeout_s=TIMEOUT_S) as engine:
        seg = engine.alloc_shared("kv", SEG_BYTES)
        seg[:] = random.Random(SEED).randbytes(SEG_BYTES)
        _say({"address": engine.address, "pid": os.getpid()})
        sys.stdin.read()


def client() -> None:
    """Run transfer commands from stdin."""
    with TransferEngine(secret=SECRET, transport="tcp", serve=False,
                        timeout_s=TIMEOUT_S) as engine:
        local = engine.alloc_shared("local", 128 << 20)
        base = ctypes.addressof(ctypes.c_char.from_buffer(local))
        for line in sys.stdin:
            req = json.loads(line)
            cmd = req["cmd"]
            if cmd == "open":
                _say({"handle": engine.open_segment(req["peer"], "kv")})
            elif cmd == "submit":
                n, count, pos = req["n"], req["count"], req.get("pos", 0)
                batch = engine.allocate_batch(count)
                engine.submit_transfer(batch, [
                    TransferRequest(Op[req["op"]], base + pos + i * n, req["handle"], req["off"],
                                    n) for i in range(count)])
                _say({"batch": batch})
            elif cmd == "wait":
                start = time.monotonic()
                try:
                    engine.wait_sync(req["batch"])
                    _say({"ok": True, "error": "", "elapsed": time.monotonic() - start})
                except TransferError as exc:
                    _say({"ok": False, "error": str(exc), "elapsed": time.monotonic() - start})
                engine.free_batch(req["batch"])
            elif cmd == "crc":
                _say({"crc": crc32c(local[req["pos"]:req["pos"] + req["n"]])})
            elif cmd == "fill":
                pos, n = req["pos"], req["n"]
                local[pos:pos + n] = random.Random(req["seed"]).randbytes(n)
                _say({"crc": crc32c(local[pos:pos + n])})


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client()
