"""Write-back: a decoding sequence's KV blocks go to the store as they fill.

A block walks: filling (its tokens' KV computed step by step) -> full (`num_computed` passed its
end; its bytes never change again) -> held (its write is in flight: even if its sequence
finishes, the pool does not hand it to another sequence) -> stored under its chained key (or
refused / failed: counted, never fatal) -> released (freed now if its sequence already finished).

Keys continue the chain the conductor started for the prompt (`block_keys(..., after=key)`), so
a follow-up turn that repeats this conversation finds these blocks, and a request moved to
another decode instance loads them instead of recomputing its whole context.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from mooncake_server.block_keys import block_keys
from mooncake_server.engine.kv_cache import PagedKVCache
from mooncake_server.engine.loop import EngineLoop
from mooncake_server.engine.model_runner import StepItem
from mooncake_server.engine.sequence import SeqStatus, Sequence
from mooncake_server.store_client.kv_link import KVStoreLink

log = logging.getLogger(__name__)


class WriteBackMetrics:
    """Prometheus series of the write-back."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Counter("mooncake_decode_writeback_blocks",
                              "Full KV blocks written back to the store, by outcome",
                              ["outcome"], registry=registry)
        self.held = Gauge("mooncake_decode_writeback_held_blocks",
                          "KV blocks pinned by a write-back in flight", registry=registry)
        self.moved_in = Counter("mooncake_decode_moved_in",
                                "Requests moved here mid-stream from another decode instance",
                                registry=registry)
        self.moved_in_loaded = Counter(
            "mooncake_decode_moved_in_loaded_tokens",
            "Tokens of moved-in requests whose KV came from the store (not recomputed)",
            registry=registry)


@dataclass
class _Track:
    namespace: str
    keys: list[str]  # chained keys of the sequence's leading full blocks known so far
    done: int  # leading full blocks already in the store or being written


class BlockWriteBack:
    """Writes each tracked sequence's newly full KV blocks to the store, in the background."""

    def __init__(self, kv: PagedKVCache, link: KVStoreLink, metrics: WriteBackMetrics) -> None:
        self.kv = kv
        self.link = link
        self.metrics = metrics
        self._tracks: dict[str, _Track] = {}
        self._held: dict[int, bool] = {}  # block id -> its sequence finished (free once written)
        self._tasks: set[asyncio.Task[None]] = set()
        # Told when a finished write frees blocks (the loop's free-blocks gauge follows).
        self.on_free: Callable[[], None] | None = None

    @property
    def held_blocks(self) -> int:
        """Blocks pinned by writes in flight."""
        return len(self._held)

    def track(self, seq: Sequence, namespace: str, keys: list[str], stored: int) -> None:
        """Write back `seq`'s blocks from `stored` on; `keys` are its known leading block keys."""
        self._tracks[seq.request_id] = _Track(namespace, list(keys), stored)

    def progress(self, seq: Sequence) -> None:
        """Start writing the blocks of `seq` that became full since the last call."""
        track = self._tracks.get(seq.request_id)
        if track is None:
            return
        bt = self.kv.layout.block_tokens
        full = min(seq.num_computed // bt, len(seq.block_ids))
        if full <= track.done:
            return
        if len(track.keys) < full:
            start = len(track.keys)
            track.keys += block_keys(seq.token_ids[start * bt:full * bt], bt, track.namespace,
                                     after=track.keys[-1] if track.keys else None)
        keys = track.keys[track.done:full]
        ids = seq.block_ids[track.done:full]
        track.done = full
        for b in ids:
            self._held[b] = False
        self.metrics.held.set(len(self._held))
        task = asyncio.get_running_loop().create_task(self._write(keys, ids))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release(self, seq: Sequence) -> None:
        """`seq` finishes: write its last full blocks; those still being written leave
        `seq.block_ids` and are freed when their write ends."""
        self.progress(seq)
        self._tracks.pop(seq.request_id, None)
        if not self._held:
            return
        mine = [b for b in seq.block_ids if b in self._held]
        for b in mine:
            self._held[b] = True
        if mine:
            seq.block_ids = [b for b in seq.block_ids if b not in self._held]

    async def _write(self, keys: list[str], ids: list[int]) -> None:
        try:
            sums = await self.link.checksums(ids)
            stored = await self.link.save(keys, ids, sums)
            self.metrics.blocks.labels("stored").inc(sum(stored))
            if not all(stored):
                self.metrics.blocks.labels("refused").inc(stored.count(False))
        except Exception as exc:  # noqa: BLE001 - a lost write-back only costs compute
            log.warning("writing back %d KV blocks failed: %s", len(ids), exc)
            self.metrics.blocks.labels("failed").inc(len(ids))
        finally:
            done = [b for b in ids if self._held.pop(b, False)]
            if done:
                self.kv.free(done)
                if self.on_free is not None:
                    self.on_free()
            self.metrics.held.set(len(self._held))

    async def close(self, timeout_s: float) -> None:
        """Wait (bounded) for writes in flight; cancel what is left."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


class WriteBackLoop(EngineLoop):
    """The continuous-batching loop, telling a BlockWriteBack about every step and finish."""

    def __init__(self, *args: object, writeback: BlockWriteBack, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.writeback = writeback
        writeback.on_free = lambda: self.metrics.free_blocks.set(self.kv.num_free)

    def _postprocess(self, items: list[StepItem], logits: object) -> None:
        super()._postprocess(items, logits)
        for it in items:
            if it.seq.status is SeqStatus.RUNNING:
                self.writeback.progress(it.seq)

    def _finish(self, seq: Sequence, error: str | None = None) -> None:
        # NOTE: before the base class frees the blocks: blocks being written stay out of the pool.
        if seq.status is not SeqStatus.FINISHED:
            self.writeback.release(seq)
        super()._finish(seq, error)
