"""Decode write-back: full blocks go to the store under the chained keys as they fill; a block
being written is never handed to another sequence, even when its own sequence finished."""

from __future__ import annotations

import asyncio

import torch
from prometheus_client import CollectorRegistry

from mooncake_server.block_keys import block_keys
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.sequence import Sequence
from mooncake_server.roles.decode.writeback import BlockWriteBack, WriteBackMetrics
from mooncake_server.wire.jobs import SamplingParams

NS = "test-namespace"
BT = 4


class SlowLink:
    """Stands in for KVStoreLink: records saves, which finish when `gate` opens."""

    def __init__(self) -> None:
        self.saved: list[tuple[list[str], list[int]]] = []
        self.gate = asyncio.Event()

    async def checksums(self, block_ids: list[int]) -> list[int]:
        return [b * 7 for b in block_ids]

    async def save(self, keys: list[str], block_ids: list[int],
                   checksums: list[int]) -> list[bool]:
        self.saved.append((keys, block_ids))
        await self.gate.wait()
        return [True] * len(keys)


def setup() -> tuple[PagedKVCache, SlowLink, BlockWriteBack, WriteBackMetrics]:
    kv = PagedKVCache(KVLayout(1, 1, 2, BT, torch.float32), num_blocks=16)
    link = SlowLink()
    metrics = WriteBackMetrics(CollectorRegistry())
    return kv, link, BlockWriteBack(kv, link, metrics), metrics  # type: ignore[arg-type]


def sequence(kv: PagedKVCache, tokens: list[int], prompt_len: int) -> Sequence:
    seq = Sequence("r1", tokens, prompt_len, SamplingParams(max_tokens=64), 1024)
    seq.block_ids = kv.allocate(kv.layout.blocks_for(len(tokens)))
    return seq


async def test_blocks_are_written_as_they_fill_under_chained_keys() -> None:
    kv, link, wb, metrics = setup()
    prompt = list(range(10, 20))  # 2 full blocks (in the store already) + a tail
    seq = sequence(kv, [*prompt, 99], len(prompt))
    known = block_keys(prompt, BT, NS)
    wb.track(seq, NS, known, stored=2)
    seq.num_computed = 10
    wb.progress(seq)
    assert link.saved == []  # block 2 is not full yet
    seq.token_ids += [100, 101]
    seq.block_ids += kv.allocate(1)
    seq.num_computed = 12  # block 2 = tokens 8..11 is full now
    wb.progress(seq)
    await asyncio.sleep(0)
    assert link.saved == [(block_keys(seq.token_ids[:12], BT, NS)[2:3], seq.block_ids[2:3])]
    assert wb.held_blocks == 1
    link.gate.set()
    await asyncio.sleep(0.01)
    assert wb.held_blocks == 0
    assert metrics.blocks.labels("stored")._value.get() == 1


async def test_a_finished_sequence_keeps_blocks_being_written_out_of_the_pool() -> None:
    kv, link, wb, _ = setup()
    seq = sequence(kv, list(range(9)), 8)
    wb.track(seq, NS, [], stored=0)
    seq.num_computed = 8
    wb.progress(seq)  # blocks 0 and 1 are being written
    being_written = list(seq.block_ids[:2])
    wb.release(seq)  # the sequence finishes meanwhile
    assert seq.block_ids == [b for b in seq.block_ids if b not in being_written]
    kv.free(seq.block_ids)  # what the engine loop frees now
    free_now = kv.num_free
    assert free_now == 16 - 2
    link.gate.set()
    await asyncio.sleep(0.01)
    assert kv.num_free == 16  # back once written
    assert link.saved[0][0] == block_keys(list(range(8)), BT, NS)
