"""A decode whose store holds another writer's copy of a prompt block (a prefix shared with a
request whose passes ran in other shapes: the store keeps the first copy of a key) recomputes
from that block and answers as if it had loaded its own prefill's KV; it is never refused."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch
from prometheus_client import CollectorRegistry, Counter

from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.engine.model_runner import ModelRunner, StepItem
from mooncake_server.engine.sequence import Sequence
from mooncake_server.roles.decode.app import DecodeService
from mooncake_server.transfer import crc32c
from mooncake_server.wire.jobs import DecodeJob, SamplingParams

BT = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class StoreCopies:
    """Stands in for KVStoreLink: the store's bytes per key, read into the decode's pool."""

    def __init__(self, kv: PagedKVCache, blocks: dict[str, torch.Tensor]) -> None:
        self.kv = kv
        self.blocks = blocks

    async def load(self, keys: list[str], block_ids: list[int], *, fallback: bool = True) -> int:
        for n, (key, b) in enumerate(zip(keys, block_ids)):
            if key not in self.blocks:
                return n
            self.kv.pool[b].copy_(self.blocks[key])
        return len(keys)

    async def checksums(self, block_ids: list[int]) -> list[int]:
        return [crc32c(self.kv.block_addr(b), self.kv.layout.block_bytes) for b in block_ids]

    async def remove(self, keys: list[str]) -> None:
        return None


def prefill(runner: ModelRunner, prompt: list[int]) -> tuple[int, list[torch.Tensor], list[int]]:
    """The prefill's side: first token, each block's KV as computed, their checksums."""
    kv = runner.kv
    seq = Sequence("p", list(prompt), len(prompt), GREEDY, 512)
    seq.block_ids = kv.allocate(kv.layout.blocks_for(len(prompt)))
    first = int(runner.step([StepItem(seq, len(prompt))])[0].argmax())
    blocks = [kv.pool[b].clone() for b in seq.block_ids]
    sums = [crc32c(kv.block_addr(b), kv.layout.block_bytes) for b in seq.block_ids]
    kv.free(seq.block_ids)
    return first, blocks, sums


async def decode(model: torch.nn.Module, prompt: list[int],
                 copies: dict[int, torch.Tensor]) -> tuple[list[int], dict[str, float]]:
    """Decode `prompt` from its prefill's KV, the store holding `copies` (block index -> bytes)
    in place of that prefill's blocks; (tokens, counters)."""
    kv = PagedKVCache(KVLayout.from_model_config(model.config, BT, torch.float32), num_blocks=64)
    runner = ModelRunner(model, kv)
    first, blocks, sums = prefill(runner, prompt)
    keys = [f"k{i}" for i in range(len(prompt) // BT)]
    stored = {key: copies.get(i, block) for i, (key, block) in enumerate(zip(keys, blocks))}
    stored["tail"] = blocks[-1]
    reg = CollectorRegistry()
    counters = [Counter(name, name, registry=reg)
                for name in ("verified", "recomputed", "mismatched")]
    loop = EngineLoop(runner, ThreadPoolExecutor(1), EngineMetrics(reg), max_batch_size=4,
                      prefill_chunk_tokens=64)
    service = DecodeService(loop, StoreCopies(kv, stored), 512,  # type: ignore[arg-type]
                            Counter("failures", "f", registry=reg), *counters)
    loop.start()
    try:
        seq = await service.admit(DecodeJob(
            request_id="r", prompt_token_ids=prompt, first_token=first, block_keys=keys,
            tail_key="tail", block_checksums=sums, sampling=GREEDY))
        tokens = [first] + [int(line.split(b'"token_id":')[1].split(b",")[0])
                            async for line in service.stream(seq)]
    finally:
        await loop.stop()
    values = {name: reg.get_sample_value(f"{name}_total") for name in
              ("verified", "recomputed", "mismatched")}
    return tokens, values


def test_another_writers_copy_of_a_block_is_recomputed_not_refused(tiny_model_pair) -> None:
    ref, model = tiny_model_pair
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 250, (14,), generator=g).tolist()  # 3 full blocks and a tail
    ids = torch.tensor([prompt])
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False)[0, len(prompt):].tolist()
    own, counts = asyncio.run(decode(model, prompt, {}))
    assert own == expected and counts == {"verified": 4, "recomputed": 0, "mismatched": 0}
    # Block 1 in the store is not the bytes this prefill computed (far off, so that decoding
    # over them would change the answer): blocks 1.. are recomputed, block 0 is kept.
    _, blocks, _ = prefill(ModelRunner(model, PagedKVCache(
        KVLayout.from_model_config(model.config, BT, torch.float32), num_blocks=8)), prompt)
    other, counts = asyncio.run(decode(model, prompt, {1: blocks[1] * 3 + 1}))
    assert other == expected
    assert counts == {"verified": 1, "recomputed": 14 - BT, "mismatched": 3}
