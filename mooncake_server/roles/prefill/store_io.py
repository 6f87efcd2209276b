"""The prefill's whole-block store reads and writes, and what it does when the store fails.

A store that fails or is full never fails a job: a prefix it cannot serve is computed, and
blocks it cannot take are left for the decode side to recompute (counted in
`mooncake_prefill_store_errors` by operation).
"""

from __future__ import annotations

import logging

from mooncake_server.config import ServerConfig
from mooncake_server.engine.core_budget import machine_cores
from mooncake_server.roles.prefill.kv_stream import LayerStream
from mooncake_server.roles.prefill.metrics import PrefillMetrics
from mooncake_server.store_client.client import StoreError
from mooncake_server.store_client.kv_link import KVStoreLink

log = logging.getLogger(__name__)


async def load_prefix(link: KVStoreLink, metrics: PrefillMetrics, keys: list[str],
                      block_ids: list[int]) -> int:
    """Cached prefix blocks read into `block_ids`; 0 (compute everything) if the store fails."""
    if not keys:
        return 0
    try:
        return await link.load(keys, block_ids, fallback=False)
    except StoreError as exc:
        log.warning("prefix lookup failed, computing the whole prompt: %s", exc)
        metrics.store_errors.labels("load").inc()
        return 0


async def save_blocks(link: KVStoreLink, metrics: PrefillMetrics, keys: list[str],
                      block_ids: list[int], checksums: list[int]) -> None:
    """Write new blocks; blocks the store cannot take are recomputed by the decode side."""
    try:
        stored = await link.save(keys, block_ids, checksums)
    except StoreError as exc:
        log.warning("storing %d KV blocks failed: %s", len(keys), exc)
        metrics.store_errors.labels("save").inc()
        return
    note_refused(metrics, stored)


def note_refused(metrics: PrefillMetrics, stored: list[bool]) -> None:
    """Count and log the blocks a full store refused (`stored`: one flag per block)."""
    if not all(stored):
        log.warning("the store refused %d of %d KV blocks (full); decode recomputes them",
                    stored.count(False), len(stored))
        metrics.store_errors.labels("refused").inc()


def streams_layers(config: ServerConfig) -> bool:
    """--kv-write; `auto` streams layers only where copying does not slow the forward.

    Over TCP or shared memory the engine's threads copy each layer on the CPU; when the
    forward's team already fills every core they preempt it, and every OpenMP region
    waits for its descheduled thread: measured on 2 cores, 1k-token TTFT 0.39-0.41 s
    writing after the forward against 0.49-0.57 s streaming layers.
    """
    mode = config.kv_write
    if mode != "auto":
        return mode == "layer"
    threads = config.torch_threads
    return config.transport == "rdma" or bool(threads and threads < machine_cores())


async def finish_writes(link: KVStoreLink, metrics: PrefillMetrics, stream: LayerStream | None,
                        keys: list[str], block_ids: list[int], checksums: list[int]) -> None:
    """put_end of the blocks `stream` wrote layer by layer, or (no stream, or it failed) write
    them whole now."""
    if stream is not None:
        try:
            stored = await stream.finish(dict(zip(keys, checksums)))
            note_refused(metrics, [stored[k] for k in keys])
            return
        except StoreError as exc:
            log.warning("streaming %d KV blocks failed, writing them whole: %s", len(keys), exc)
            metrics.store_errors.labels("stream").inc()
    await save_blocks(link, metrics, keys, block_ids, checksums)
