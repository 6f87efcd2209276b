"""A colocated engine and a disaggregated cluster over the tiny random model, in this process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mooncake_server.config import ServerConfig
from mooncake_testkit.in_process import AppCluster, wait_healthy


def tiny_config(role: str, port: int, model: str, secret: str, **extra: Any) -> ServerConfig:
    """One role of the tiny cluster: float32 (exact), small pools, TCP, fast heartbeats."""
    return ServerConfig(role=role, port=port, model=model, served_model_name="tiny",
                        cluster_secret=secret, dtype="float32", kv_memory_bytes=8 << 20,
                        store_memory_bytes=64 << 20, max_batch_size=8, prefill_chunk_tokens=64,
                        heartbeat_interval_s=0.2, transport="tcp", transfer_timeout_s=5.0,
                        **extra)


@contextmanager
def tiny_clusters(model: str, secret: str) -> Iterator[dict[str, str]]:
    """URLs: colocated, disaggregated (the conductor of store + prefill + decode), prefill,
    decode."""
    with AppCluster() as apps:
        apps.add("colocated", lambda port: tiny_config("colocated", port, model, secret))
        conductor = apps.add("conductor",
                             lambda port: tiny_config("conductor", port, model, secret))
        for role in ("store", "prefill", "decode"):
            apps.add(role, lambda port, role=role: tiny_config(role, port, model, secret,
                                                               conductor_url=conductor))
        wait_healthy(conductor, 30.0)
        yield {"colocated": apps.urls["colocated"], "disaggregated": conductor,
               "prefill": apps.urls["prefill"], "decode": apps.urls["decode"]}
