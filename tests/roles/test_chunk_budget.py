"""Prefill passes beside a decode: sized so the decode's token gaps fit the TBT SLO."""

from __future__ import annotations

from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.roles.prefill.chunk_budget import MIN_CHUNK, ChunkBudget

# A pass: 10 ms + 1 ms per prompt token.
MODEL = PerfModel(prefill_a=0.0, prefill_b=1e-3, prefill_c=0.01, prefill_e=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_a_tbt_slo_the_decode_chunk_is_the_chunk() -> None:
    assert ChunkBudget(256, MODEL, None).tokens() == 256
    assert ChunkBudget(256).tokens() == 256


def test_a_pass_is_sized_to_half_the_tbt_slo_by_its_measured_speed() -> None:
    clock = Clock()
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=clock)
    assert chunks.tokens() == 90  # 10 + 90 ms = 100 ms, half the SLO
    for _ in range(30):  # this machine runs passes twice as slow as the model
        chunks.observe(tokens=64, cached_tokens=0, compute_s=2 * MODEL.prefill_s(64))
    assert chunks.tokens() == 40  # 2 x (10 + 40) ms = 100 ms
    clock.now += 11.0  # no pass for the horizon: the model's own times again
    assert chunks.tokens() == 90


def test_a_slow_machine_still_gets_the_smallest_useful_chunk() -> None:
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.02)
    assert chunks.tokens() == MIN_CHUNK
    assert ChunkBudget(8, MODEL, tbt_slo_s=0.02).tokens() == 8  # never above --decode-chunk
