"""`--role colocated` with SLO flags: bursts decided cheapest first over the engine's own work,
passes beside decoding rows sized to the TBT SLO, late prompts refused before any work."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from mooncake_server.api.backend import BackendError, GenerateRequest
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.engine.model_runner import ModelRunner
from mooncake_server.engine.sequence import LATE_FOR_SLO
from mooncake_server.roles.colocated.admission import ColocatedAdmission
from mooncake_server.roles.colocated.backend import LocalEngineBackend
from mooncake_server.wire.jobs import SamplingParams

# Round numbers: 1 ms per prompt token + 10 ms per pass; a step 20 ms + 5 ms per row.
MODEL = PerfModel(prefill_a=0.0, prefill_b=1e-3, prefill_c=0.01, prefill_e=0.0,
                  decode_d0=0.02, decode_d1=0.005, decode_d2=0.0, block_tokens=4)


def engine(paged: torch.nn.Module, *, ttft_slo: float | None = 1.0,
           tbt_slo: float | None = None) -> tuple[LocalEngineBackend, EngineLoop,
                                                   ColocatedAdmission]:
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    loop = EngineLoop(ModelRunner(paged, PagedKVCache(layout, num_blocks=600)),
                      ThreadPoolExecutor(1), EngineMetrics(CollectorRegistry()),
                      max_batch_size=8, prefill_chunk_tokens=2048, decode_chunk_tokens=256)
    admission = ColocatedAdmission(loop, MODEL, ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
                                   window_s=0.0)
    return LocalEngineBackend(loop, 2048, admission), loop, admission


def request(rid: str, n: int, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, [5] * n, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                        ignore_eos=True))


async def test_a_burst_is_admitted_cheapest_first_and_the_rest_refused(tiny_model_pair) -> None:
    """Five prompts at once with a 1 s TTFT SLO: 100, 200 and 300 tokens fit one after the
    other (0.11, 0.32, 0.63 s), 500 and 800 do not; the engine gets them in that order."""
    _, paged = tiny_model_pair
    backend, loop, admission = engine(paged)  # never started: the work stays queued
    sizes = {"a800": 800, "b100": 100, "c300": 300, "d500": 500, "e200": 200}
    reqs = {rid: request(rid, n) for rid, n in sizes.items()}
    got = await asyncio.gather(*(admission.admit(r, backend._choices(r)) for r in reqs.values()),
                               return_exceptions=True)
    refused = {rid for rid, g in zip(reqs, got) if isinstance(g, BackendError)}
    assert refused == {"a800", "d500"}
    assert all(g.status == 429 for g in got if isinstance(g, BackendError))
    assert [s.request_id for s in loop.waiting] == ["b100", "e200", "c300"]
    assert admission.gate.bursts == 1 and admission.rejected == 2


def test_one_token_prompts_are_no_decoding_rows_a_bursts_first_pass_runs_whole(
        tiny_model_pair) -> None:
    """A burst's one-token prompts have one token pending, as a decoding row does; read as rows,
    they cut the burst's first pass to a TBT-sized chunk and its long prompts ran one after
    the other beside them (a 734-token one took 6.6 s where 2.2 s was estimated)."""
    _, paged = tiny_model_pair
    backend, loop, _ = engine(paged, tbt_slo=0.2)  # never started: passes picked by hand
    sizes = {"one": 1, "also-one": 1, "mid": 300, "long": 500}
    for rid, n in sizes.items():
        for seq in backend._choices(request(rid, n)):
            loop.submit(seq)
    items = loop._schedule()
    assert {it.seq.request_id: it.num_new for it in items} == sizes  # all whole, in one pass
    for it in items:  # computed: the prompts now decode, and the next pass is theirs
        it.seq.num_computed += it.num_new
        it.seq.token_ids.append(7)
    assert all(it.seq.decoding for it in items)
    assert {it.num_new for it in loop._schedule()} == {1}


def test_passes_beside_decoding_rows_fit_the_tbt_slo(tiny_model_pair) -> None:
    """Four rows step in 40 ms; a 200 ms SLO gives their gap 150 ms (the loop's own work takes
    the rest): 40 + 10 ms + 96 tokens. Prompt tokens measured twice as slow as modelled leave
    room for 32."""
    _, paged = tiny_model_pair
    _, _, admission = engine(paged, tbt_slo=0.2)
    assert admission.chunk_for(4, 100) == 96
    for _ in range(30):
        admission.observed(96, 4, 100, 0.04 + 2 * MODEL.prefill_s(96))
    assert admission.chunk_for(4, 100) == 32


async def test_what_a_bursts_first_pass_leaves_runs_in_cut_passes(tiny_model_pair) -> None:
    """An idle engine computes up to --prefill-chunk prompt tokens in its next pass; the rest
    runs beside the rows that pass made, in chunks sized to their gap. Estimated at full speed,
    a burst's 1,518-token prompt was admitted at 1.25 s and answered far past its SLO."""
    _, paged = tiny_model_pair
    backend, _, admission = engine(paged, ttft_slo=5.0, tbt_slo=0.2)
    await admission.admit(request("big", 2000), backend._choices(request("big", 2000)))
    ttft, tbt, own = admission.estimate(500)
    # 2048 tokens at full speed (2.058 s); 452 beside one row (25 ms steps): chunks of 112
    # (10 + 112 + 25 ms = 147 ms <= 150 ms): 4 x 147 ms + (10 + 4 + 25) ms.
    assert ttft == pytest.approx(2.058 + 0.588 + 0.039)
    assert own == pytest.approx(0.01 + 0.048 + 0.588 + 0.039)
    assert tbt == pytest.approx(0.15)  # prompts that come beside it: 0.75 of the SLO


def test_a_cold_first_pass_does_not_make_an_idle_engine_refuse(tiny_model_pair) -> None:
    """The first request's prefill pass ran 30x its model (allocations, a cold start); the
    steps after it ran at a third of theirs. The next request alone is judged by the steps."""
    _, paged = tiny_model_pair
    _, _, admission = engine(paged, tbt_slo=0.2)
    admission.seed_quiet_step(1, 5, 0.33 * MODEL.decode_step_s(1, 5))
    admission.observed(16, 0, 0, 30 * MODEL.prefill_s(16))
    for i in range(3):
        admission.observed(0, 1, 17 + i, 0.33 * MODEL.decode_step_s(1, 17 + i))
    ttft, tbt, _ = admission.estimate(128)
    assert admission.decode_ratio == pytest.approx(0.33, rel=0.01)
    assert tbt <= 0.2
    assert ttft < 0.33 * MODEL.prefill_s(128) * 1.01  # the prefill ratio: decode's, until 3


def test_a_prompt_pass_timed_at_start_is_the_prompt_speed_beside_recent_passes(
        tiny_model_pair) -> None:
    """Steps ran at a third of the model, prompts at 1.5x: the start-up prompt pass says so
    before any prompt ran (the decode's ratio read the first burst at a fifth of its time),
    and stays a prior, weighed by its modelled time, beside the passes that follow."""
    _, paged = tiny_model_pair
    _, _, admission = engine(paged, tbt_slo=0.2)
    admission.seed_quiet_step(1, 5, 0.33 * MODEL.decode_step_s(1, 5))
    admission.seed_prompt_pass(500, 1.5 * MODEL.prefill_s(500))
    assert admission.prefill_ratio == pytest.approx(1.5)
    ttft, _, _ = admission.estimate(1000)
    assert ttft == pytest.approx(1.5 * MODEL.prefill_s(1000))
    admission.observed(100, 0, 0, 1.0 * MODEL.prefill_s(100))  # one pass at the model's speed
    assert admission.prefill_ratio == pytest.approx((1.5 * 0.51 + 0.11) / (0.51 + 0.11))


async def test_a_prompt_past_its_start_deadline_gets_429_before_any_work(tiny_model_pair) -> None:
    """Accepted, then held up (here: its deadline set in the past as it is submitted): when its
    turn comes it ends without computing anything, the client gets 429, no block is kept."""
    _, paged = tiny_model_pair
    backend, loop, _ = engine(paged, ttft_slo=5.0)
    submit = loop.submit

    def late_submit(seq):  # type: ignore[no-untyped-def]
        seq.start_by = 0.0
        submit(seq)

    loop.submit = late_submit  # type: ignore[method-assign]
    computed = loop.metrics.computed_prompt_tokens
    loop.start()
    try:
        with pytest.raises(BackendError) as info:
            async for _ in backend.generate(request("late", 40)):
                pass
        assert info.value.status == 429 and LATE_FOR_SLO in str(info.value)
        assert computed._value.get() == 0  # noqa: SLF001 - nothing was computed
        assert loop.kv.num_free == loop.kv.num_blocks
        loop.submit = submit  # type: ignore[method-assign]
        events = [e async for e in backend.generate(request("on-time", 40))]
        assert len(events) == 4
    finally:
        await loop.stop()


async def test_admitted_requests_still_match_plain_serving(tiny_model_pair) -> None:
    """Admission decides when a prompt starts, never what it computes: the same greedy tokens."""
    _, paged = tiny_model_pair
    plain, plain_loop, _ = engine(paged, ttft_slo=None)
    plain.admission = None
    gated, gated_loop, _ = engine(paged, ttft_slo=30.0, tbt_slo=5.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (7, 30, 19)]
    outs = []
    for backend, loop in ((plain, plain_loop), (gated, gated_loop)):
        loop.start()
        try:
            outs.append(await asyncio.gather(*(
                _tokens(backend, GenerateRequest(f"r{i}", p, SamplingParams(
                    max_tokens=8, temperature=0, ignore_eos=True)))
                for i, p in enumerate(prompts))))
        finally:
            await loop.stop()
    assert outs[0] == outs[1]


async def _tokens(backend: LocalEngineBackend, req: GenerateRequest) -> list[int]:
    return [e.token_id async for e in backend.generate(req)]


def test_the_prompt_speed_outlasts_the_gap_between_bursts(tiny_model_pair) -> None:
    """Bursts come tens of seconds apart: 30 s after the last pass with prompt tokens, a pass
    is still sized and timed by their speed, not by the decode steps' (a third of it here)."""
    _, paged = tiny_model_pair
    _, _, admission = engine(paged, tbt_slo=0.2)
    admission.seed_quiet_step(1, 5, 0.33 * MODEL.decode_step_s(1, 5))
    for _ in range(5):
        admission.observed(96, 0, 0, 1.5 * MODEL.prefill_s(96))
    later = time.monotonic() + 30.0
    admission.prefill._recent._clock = lambda: later  # noqa: SLF001 - its own clock
    assert admission.prefill_ratio == pytest.approx(1.5)
