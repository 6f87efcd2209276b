"""A real cluster in one process for the scheduler's integration tests: conductor, store, two
prefill instances (one streaming KV layer by layer, one writing after the forward) and a decode
instance with a small KV pool, every role's real app over a tiny random Llama, KV over TCP.

The apps share one event loop in a background thread (testkit's `AppCluster`), so tests drive
them with blocking clients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from mooncake_server.config import ServerConfig
from mooncake_testkit.in_process import AppCluster

SECRET = "sched-cluster-secret"
BLOCK = 4  # tokens per KV block
DECODE_BLOCKS = 64  # the decode pool: two worst-case requests of the 128-token context


@dataclass
class Cluster:
    """Base URLs of each role; `prefill` lists prefill-0 (layer-wise) then prefill-1 (after).

    `conductor_app` is the conductor's app itself: the apps run in this process (`apps`).
    """

    apps: AppCluster

    conductor: str = ""
    store: str = ""
    prefill: list[str] = field(default_factory=list)
    decode: str = ""
    headers: dict[str, str] = field(default_factory=lambda: {"X-Mooncake-Secret": SECRET})
    conductor_app: Any = None

    def metric(self, url: str, name: str) -> float:
        """Sum of one metric's samples on one role."""
        text = httpx.get(url + "/metrics", headers=self.headers, timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith(name + "_created"))

    def stop(self) -> None:
        """Stop every role's app."""
        self.apps.stop()


def _config(role: str, port: int, model: str, **extra: Any) -> ServerConfig:
    settings: dict[str, Any] = {
        "role": role, "port": port, "model": model, "served_model_name": "tiny",
        "cluster_secret": SECRET, "dtype": "float32", "block_tokens": BLOCK, "kv_memory_bytes": 1 << 20,
        "store_memory_bytes": 16 << 20, "prefill_chunk_tokens": 8, "heartbeat_interval_s": 0.2,
        "transport": "tcp", "transfer_timeout_s": 5.0}
    return ServerConfig(**{**settings, **extra})


def start(model: str, policy: str, **slo: Any) -> Cluster:
    """Start every role; returns once the conductor sees all of them (stop it with `stop`).

    `slo`: settings of both the conductor and the decode instance (the SLOs, the cost model),
    as `--role all` passes them.
    """
    c = Cluster(AppCluster())
    try:
        def serve(name: str, role: str, **extra: Any) -> str:
            if role != "conductor":
                extra["conductor_url"] = c.conductor
            return c.apps.add(name, lambda port: _config(role, port, model, **extra))

        c.conductor = serve("conductor", "conductor", policy=policy, **slo)
        c.conductor_app = c.apps.apps["conductor"]
        c.store = serve("store", "store")
        c.prefill = [serve("prefill-0", "prefill", instance_id="prefill-0", kv_write="layer"),
                     serve("prefill-1", "prefill", instance_id="prefill-1", kv_write="after")]
        block_bytes = 2 * 2 * BLOCK * 1 * 16 * 4  # layers x (K, V) x tokens x kv heads x dim x f32
        c.decode = serve("decode-0", "decode", instance_id="decode-0",
                         kv_memory_bytes=DECODE_BLOCKS * block_bytes, **slo)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = httpx.get(c.conductor + "/health", timeout=5)
            if r.status_code == 200 and r.json()["instances"]["prefill"] == 2:
                return c
            time.sleep(0.05)
        raise RuntimeError("cluster did not become healthy")
    except BaseException:
        c.stop()
        raise
