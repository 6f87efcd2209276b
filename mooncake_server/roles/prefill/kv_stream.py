"""Layer-wise KV streaming: a prefill writes each layer of its new blocks to the store as soon as
that layer is computed, so the transfer overlaps the rest of the forward pass.

A stream walks: `open` (one `place` query, then put_start on every target node, in parallel: the
space is reserved before the forward; blocks already complete — a local-cache hit the store may
lack — are written whole at once) -> per prompt chunk, `plan_chunk` names the blocks that chunk
completes -> the forward calls `on_layer(l)` after layer l's K/V are in the pool, which queues one
WRITE per (block, target) of that layer's contiguous slice and returns (the native engine's
threads move the bytes) -> `finish`: wait for every WRITE, then put_end with the checksums on each
node (a reader may start only now: decode begins when the last layer has landed) -> or `abort`.

A block is `[layers, 2, block_tokens, kv_heads, head_dim]`, so layer l of a block is the byte
range `[l * layer_bytes, (l + 1) * layer_bytes)`, K then V. A block is streamed only in the chunk
that completes it, so every byte range is written exactly once, after its last token landed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from mooncake_server.store_client.client import StoreError
from mooncake_server.store_client.cluster import StoreUnavailable
from mooncake_server.store_client.kv_link import KVStoreLink
from mooncake_server.transfer import Op, TransferError, TransferRequest
from mooncake_server.wire.instances import StoreLocation

log = logging.getLogger(__name__)


@dataclass
class _Block:
    key: str
    block_id: int
    complete_at: int  # prompt tokens computed once this block is complete
    targets: list[tuple[int, int]] = field(default_factory=list)  # (segment handle, offset)
    present: bool = False  # a target already holds it (or another writer is filling it)


class LayerStream:
    """One prefill job's new blocks on their way to the store, layer by layer."""

    def __init__(self, link: KVStoreLink, blocks: list[_Block],
                 reserved: dict[str, tuple[StoreLocation, list[str]]], computed: int) -> None:
        self._link = link
        self._engine = link.engine
        layout = link.kv.layout
        self._layers = layout.num_layers
        self._layer_bytes = layout.block_bytes // layout.num_layers
        self._block_bytes = layout.block_bytes
        self._blocks = blocks
        self._reserved = reserved  # node id -> (where, keys reserved there)
        ready = [b for b in blocks if b.targets and b.complete_at <= computed]
        self._pending = [b for b in blocks if b.targets and b.complete_at > computed]
        self._current: list[_Block] = []
        self._error: Exception | None = None
        self.submitted = 0
        n = sum(len(b.targets) for b in ready) + sum(len(b.targets) * self._layers
                                                     for b in self._pending)
        self._batch = self._engine.allocate_batch(n) if n else None
        self._write_whole(ready)

    @classmethod
    async def open(cls, link: KVStoreLink, keys: list[str], block_ids: list[int],
                   complete_at: list[int], computed: int) -> LayerStream:
        """Reserve space for `keys` on their store nodes; write blocks complete by `computed`.

        Raises StoreUnavailable when no store node is alive, StoreError when the index fails.
        """
        blocks = [_Block(k, b, c) for k, b, c in zip(keys, block_ids, complete_at)]
        reserved: dict[str, tuple[StoreLocation, list[str]]] = {}
        if keys:
            place = await link.cluster.place(keys)
            if not place.nodes:
                raise StoreUnavailable(f"no live store node can take {len(keys)} blocks")
            groups: dict[str, list[int]] = {}
            for i, nodes in enumerate(place.targets):
                for node in nodes:
                    groups.setdefault(node, []).append(i)
            size = link.kv.layout.block_bytes
            replies = await asyncio.gather(*[
                _reserve(link, place.nodes[node], [keys[i] for i in idx], size)
                for node, idx in groups.items()])
            for (node, idx), reply in zip(groups.items(), replies):
                if reply is None:
                    continue  # node failed: the other replicas (or decode's recompute) cover it
                handle, offsets, refused = reply
                taken = []
                for i, off in zip(idx, offsets):
                    if off is not None:
                        blocks[i].targets.append((handle, off))
                        taken.append(keys[i])
                    elif keys[i] not in refused:
                        blocks[i].present = True
                if taken:
                    reserved[node] = (place.nodes[node], taken)
        return cls(link, blocks, reserved, computed)

    # ---- the forward ------------------------------------------------------------------------

    def plan_chunk(self, computed_after: int, final: bool) -> None:
        """Before a forward pass: stream the blocks complete once `computed_after` tokens are."""
        self._current = [b for b in self._pending if final or b.complete_at <= computed_after]
        done = {id(b) for b in self._current}
        self._pending = [b for b in self._pending if id(b) not in done]

    def on_layer(self, layer: int) -> None:
        """Forward-thread hook: queue layer `layer` of this chunk's blocks, never waiting."""
        if not self._current or self._error is not None or self._batch is None:
            return
        off = layer * self._layer_bytes
        reqs = [TransferRequest(Op.WRITE, self._link.kv.block_addr(b.block_id) + off, handle,
                                remote + off, self._layer_bytes)
                for b in self._current for handle, remote in b.targets]
        self._submit(reqs)

    def after_chunk(self) -> None:
        """After a forward pass: its blocks are queued in full."""
        self._current = []

    # ---- the end ----------------------------------------------------------------------------

    async def finish(self, checksums: dict[str, int]) -> dict[str, bool]:
        """Wait for every WRITE, then commit; per key whether a store node now holds it.

        Raises StoreError (after aborting the reservations) if a WRITE failed.
        """
        if self._pending:  # a caller that never streamed them: write them, layer by layer
            for layer in range(self._layers):
                self._current = self._pending
                self.on_layer(layer)
            self._current, self._pending = [], []
        try:
            if self._batch is not None:
                if self.submitted:
                    await self._engine.wait(self._batch)
                if self._error is not None:
                    raise StoreError(f"streaming KV layers failed: {self._error}")
        except (TransferError, OSError, StoreError) as exc:
            await self.abort()
            raise exc if isinstance(exc, StoreError) else StoreError(
                f"streaming KV layers failed: {exc}") from exc
        finally:
            self._free_batch()
        results = await asyncio.gather(*[
            self._link.client(loc).commit(keys, [checksums[k] for k in keys])
            for loc, keys in self._reserved.values()], return_exceptions=True)
        committed: dict[str, bool] = {}
        for (node, (_, keys)), res in zip(self._reserved.items(), results):
            if isinstance(res, BaseException):
                log.warning("put_end on store %s failed: %s", node, res)
                continue
            for key, ok in zip(keys, res):
                committed[key] = committed.get(key, False) or ok
        self._reserved = {}
        return {b.key: committed.get(b.key, False) or b.present for b in self._blocks}

    async def abort(self) -> None:
        """Give the reservations back (after a failure, or if the job is abandoned)."""
        self._current, self._pending = [], []
        if self._batch is not None and self.submitted:
            try:
                await self._engine.wait(self._batch)  # never free space a WRITE still targets
            except (TransferError, OSError):
                pass
        self._free_batch()
        reserved, self._reserved = self._reserved, {}
        await asyncio.gather(*[self._link.client(loc).abort(keys)
                               for loc, keys in reserved.values()])

    # ---- internals --------------------------------------------------------------------------

    def _write_whole(self, blocks: list[_Block]) -> None:
        self._submit([TransferRequest(Op.WRITE, self._link.kv.block_addr(b.block_id), handle,
                                      remote, self._block_bytes)
                      for b in blocks for handle, remote in b.targets])

    def _submit(self, reqs: list[TransferRequest]) -> None:
        if not reqs or self._batch is None or self._error is not None:
            return
        try:
            self._engine.submit_transfer(self._batch, reqs)
            self.submitted += len(reqs)
        except (TransferError, ValueError, OSError) as exc:  # NOTE: never fail the forward
            self._error = exc

    def _free_batch(self) -> None:
        if self._batch is not None:
            self._engine.free_batch(self._batch)
            self._batch = None


async def _reserve(link: KVStoreLink, loc: StoreLocation, keys: list[str],
                   size: int) -> tuple[int, list[int | None], set[str]] | None:
    """put_start on one node + its segment handle; None if the node failed."""
    client = link.client(loc)
    try:
        reply = await client.reserve(keys, [size] * len(keys))
        if all(off is None for off in reply.offsets):
            return 0, reply.offsets, set(reply.refused)
        return await client.segment(), reply.offsets, set(reply.refused)
    except StoreError as exc:
        log.warning("reserving %d blocks on store %s failed: %s", len(keys), loc.instance_id, exc)
        return None
