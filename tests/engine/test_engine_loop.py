"""The continuous-batching engine reproduces HF generate exactly and frees what it takes."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from mooncake_server.api.backend import GenerateRequest
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.engine.model_runner import ModelRunner
from mooncake_server.roles.colocated.backend import LocalEngineBackend
from mooncake_server.wire.jobs import SamplingParams


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Reference: HF generate, greedy (the tiny model has no EOS, so it never stops early)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def make_backend(paged: torch.nn.Module, num_blocks: int, block_tokens: int = 4,
                 chunk: int = 16) -> tuple[LocalEngineBackend, EngineLoop, CollectorRegistry]:
    """An engine loop over the tiny model with a small block size (many block boundaries)."""
    layout = KVLayout.from_model_config(paged.config, block_tokens, torch.float32)
    kv = PagedKVCache(layout, num_blocks=num_blocks)
    reg = CollectorRegistry()
    loop = EngineLoop(ModelRunner(paged, kv), ThreadPoolExecutor(1), EngineMetrics(reg),
                      max_batch_size=8, prefill_chunk_tokens=chunk)
    return LocalEngineBackend(loop, 512), loop, reg


async def collect(backend: LocalEngineBackend, rid: str, prompt: list[int], n: int) -> list[int]:
    """All tokens of one greedy request."""
    req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0,
                                                      ignore_eos=True))
    return [ev.token_id async for ev in backend.generate(req)]


async def test_concurrent_requests_match_hf_generate(tiny_model_pair) -> None:
    ref, paged = tiny_model_pair
    backend, loop, reg = make_backend(paged, num_blocks=200)
    loop.start()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 250, (L,), generator=g).tolist() for L in (3, 17, 40, 9, 33)]
    try:
        outs = await asyncio.gather(*(collect(backend, f"r{i}", p, 12)
                                      for i, p in enumerate(prompts)))
    finally:
        await loop.stop()
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(ref, p, 12)
    assert reg.get_sample_value("mooncake_engine_max_batch_size") > 1
    assert loop.kv.num_free == loop.kv.num_blocks


async def test_closing_the_stream_cancels_and_frees_blocks(tiny_model_pair) -> None:
    _, paged = tiny_model_pair
    backend, loop, _ = make_backend(paged, num_blocks=64)
    loop.start()
    try:
        req = GenerateRequest("c", list(range(2, 30)), SamplingParams(max_tokens=400,
                                                                      temperature=0,
                                                                      ignore_eos=True))
        gen = backend.generate(req)
        for _ in range(3):
            await gen.__anext__()
        await gen.aclose()
        deadline = asyncio.get_running_loop().time() + 5
        while loop.kv.num_free != loop.kv.num_blocks:
            assert asyncio.get_running_loop().time() < deadline, "blocks were not freed"
            await asyncio.sleep(0.01)
        assert not loop.running and not loop.waiting
    finally:
        await loop.stop()


async def test_seeded_sampling_is_reproducible(tiny_model_pair) -> None:
    _, paged = tiny_model_pair
    backend, loop, _ = make_backend(paged, num_blocks=64)
    loop.start()
    try:
        params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
                                ignore_eos=True)
        runs = []
        for i in range(2):
            req = GenerateRequest(f"s{i}", [5, 6, 7, 8], params)
            runs.append([ev.token_id async for ev in backend.generate(req)])
    finally:
        await loop.stop()
    assert runs[0] == runs[1]
    assert len(runs[0]) == 10


async def test_kv_exhaustion_fails_the_request_not_the_engine(tiny_model_pair) -> None:
    _, paged = tiny_model_pair
    backend, loop, _ = make_backend(paged, num_blocks=6)  # 24 tokens of KV
    loop.start()
    try:
        req = GenerateRequest("big", list(range(2, 12)),
                              SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        with pytest.raises(Exception, match="KV cache full"):
            async for _ in backend.generate(req):
                pass
        assert await collect(backend, "after", [3, 4, 5], 4)  # the engine still serves
    finally:
        await loop.stop()


def test_the_quiet_step_is_timed_on_a_scratch_sequence_that_gives_its_blocks_back(
        tiny_model_pair) -> None:
    _, paged = tiny_model_pair
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    runner = ModelRunner(paged, PagedKVCache(layout, num_blocks=8))
    seconds = runner.quiet_step_s(passes=5)
    assert 0.0 < seconds <= runner.last_compute_s  # the fastest pass, the last one among them
    assert runner.kv.num_free == 8
    # A prompt pass (the prefill's start-up seed) likewise: the same 12 tokens twice.
    seconds = runner.prompt_pass_s(12, passes=2)
    assert 0.0 < seconds <= runner.last_compute_s
    assert runner.kv.num_free == 8
