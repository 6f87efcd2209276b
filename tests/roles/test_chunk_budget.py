"""Prefill passes beside a decode: sized so the decode's token gaps fit the TBT SLO."""

from __future__ import annotations

import pytest

from mooncake_server.cost_model.passes import MIN_CHUNK, SEED_PASS_TOKENS, seed_pass_tokens
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.roles.prefill.chunk_budget import ChunkBudget
from mooncake_server.roles.prefill.handoff_hold import HANDOFF_GRACE_S, decode_beside
from mooncake_server.wire.instances import PassSplit

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


def test_a_pass_gets_what_the_decode_step_leaves_of_the_gap_by_its_measured_speed() -> None:
    clock = Clock()
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=clock)
    assert chunks.tokens(decode_step_s=0.05) == 90  # 50 + 10 + 90 ms = 150 ms: 0.75 of the SLO
    assert chunks.tokens(decode_step_s=0.0) == 140
    # A heavy batch's step leaves less than the least pass: the pass keeps 0.2 of the SLO.
    assert chunks.tokens(decode_step_s=0.14) == 30
    for _ in range(30):  # this machine runs passes twice as slow as the model
        chunks.observe([(64, 0)], compute_s=2 * MODEL.prefill_s(64))
    assert chunks.tokens(decode_step_s=0.05) == 40  # 2 x (10 + 40) ms = 100 ms
    clock.now += 61.0  # no pass for the horizon: the model's own times again
    assert chunks.tokens(decode_step_s=0.05) == 90


def test_a_packed_pass_is_timed_against_its_prompts_side_by_side() -> None:
    """The conductor estimates a burst's pass prompt by prompt; the speed reported must be
    measured against the same sum, or it reads fast by the attention the prompts never do."""
    model = PerfModel(prefill_a=1e-6, prefill_b=1e-3, prefill_c=0.01, prefill_e=0.0)
    chunks = ChunkBudget(256, model, tbt_slo_s=0.2, clock=Clock())
    items = [(500, 0), (500, 0), (24, 0)]
    chunks.observe(items, 1.5 * (0.01 + 2 * (0.25 + 0.5) + 0.024 + 0.000576))
    split = chunks.split(shared=False, idle_chunk=2048)
    assert split is not None and split.ratio == pytest.approx(1.5)
    assert split.measured_tokens == 1024


def test_a_full_pass_timed_at_start_up_speaks_for_the_machine_until_long_passes_do() -> None:
    """Short warm-up passes weigh the per-pass cost more than a burst's long pass does: the
    seed stands beside them (weighed by its modelled time) and never ages."""
    clock = Clock()
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=clock)
    chunks.seed(500, 1.5 * MODEL.prefill_s(500))
    split = chunks.split(shared=False, idle_chunk=2048)
    assert split is not None and split.ratio == pytest.approx(1.5) == split.cut_ratio
    assert not split.cut_timed  # no pass beside a decode yet: the cut speed is a prior
    # The conductor lets a burst's first pass run past one chunk only on speeds read from
    # passes that long: the start-up pass is one, and it never ages.
    assert split.measured_tokens == 500
    chunks.observe([(16, 0)], MODEL.prefill_s(16))  # a warm-up pass at the model's speed
    ratio = chunks.split(shared=False, idle_chunk=2048).ratio
    assert ratio == pytest.approx((1.5 * 0.51 + 1.0 * 0.026) / (0.51 + 0.026))
    for _ in range(20):  # long passes, recent: they outweigh the seed
        chunks.observe([(1000, 0)], 1.2 * MODEL.prefill_s(1000))
    assert chunks.split(shared=False, idle_chunk=2048).ratio == pytest.approx(1.2, abs=0.02)
    assert chunks.split(shared=False, idle_chunk=2048).measured_tokens == 1000
    clock.now += 61.0  # nothing recent: the seed again, not the bare model
    assert chunks.split(shared=False, idle_chunk=2048).ratio == pytest.approx(1.5)
    assert chunks.split(shared=False, idle_chunk=2048).measured_tokens == 500
    assert chunks.tokens(decode_step_s=0.05) == 56  # 1.5 x (10 + 56) ms = 99 ms of 100


def test_a_chunk_is_whole_kv_blocks() -> None:
    """The worker cuts a prompt only on a KV block boundary, so the chunk it sizes and reports
    (the conductor estimates cut passes by it) is whole blocks: 64 of the 65 tokens that fit,
    and one block where less than one fits."""
    def timed(chunks: ChunkBudget) -> ChunkBudget:
        for wait in (0.01, 0.03, 0.05, 0.07):
            chunks.observe([(64, 0)], 2 * MODEL.prefill_s(64), wait_s=wait, beside_decode=True)
        return chunks

    assert timed(ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=Clock())).tokens() == 65
    blocks = timed(ChunkBudget(256, MODEL, tbt_slo_s=0.2, block_tokens=16, clock=Clock()))
    assert blocks.tokens() == 64 and blocks.split(True, 2048).cut_tokens == 64
    assert ChunkBudget(256, MODEL, tbt_slo_s=0.02, block_tokens=32).tokens() == 32


def test_a_slow_machine_still_gets_the_smallest_useful_chunk() -> None:
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.02)
    assert chunks.tokens() == MIN_CHUNK
    assert ChunkBudget(8, MODEL, tbt_slo_s=0.02).tokens() == 8  # never above --decode-chunk


def test_it_reports_the_passes_a_prompt_would_get_now() -> None:
    """The conductor's TTFT estimate reads this: chunks, speeds and wait of the passes; cut
    passes are timed apart from full ones (their fixed cost weighs more)."""
    clock = Clock()
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=clock)
    for wait in (0.01, 0.03, 0.05, 0.07):  # cut passes beside a decode wait for its steps
        chunks.observe([(64, 0)], 2 * MODEL.prefill_s(64), wait_s=wait, beside_decode=True)
    chunks.observe([(1024, 0)], MODEL.prefill_s(1024), wait_s=0.0, beside_decode=False)
    split = chunks.split(shared=True, idle_chunk=2048)
    assert split is not None and split.shared
    assert split.chunk_tokens == 2048 and split.cut_tokens == chunks.tokens() < 75
    assert split.ratio == pytest.approx(1.0)  # the full pass ran as modelled
    assert split.cut_ratio == pytest.approx(2.0) and split.cut_timed
    assert split.wait_s == pytest.approx(0.04)  # their mean; the full pass left out
    # The full passes behind `ratio` were this long (cut ones do not count): the conductor
    # predicts a burst's pass past one chunk only from passes of a useful length.
    assert split.measured_tokens == 1024
    clock.now += 61.0  # nothing recent: the model's own times, and no wait known
    assert chunks.split(shared=False, idle_chunk=2048) == PassSplit(
        chunk_tokens=2048, cut_tokens=140, ratio=1.0, cut_ratio=1.0, wait_s=0.0, shared=False,
        cut_timed=False)
    assert chunks.split(False, 2048, decode_step_s=0.05).cut_tokens == 90  # the decode's step
    assert ChunkBudget(256).split(True, 2048) is None  # no --tbt-slo: nothing to report


def test_ttft_is_estimated_from_mean_speeds_and_a_pass_sized_by_the_slower_half() -> None:
    """A prompt's passes add up, so the TTFT estimate takes the mean speed; a single pass must
    fit the TBT budget, so its size takes the slower half's."""
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=Clock())
    for ratio in (1.0, 1.0, 1.0, 3.0):  # one cut pass in four 3x slow (a neighbour woke up)
        chunks.observe([(40, 0)], ratio * MODEL.prefill_s(40), beside_decode=True)
    split = chunks.split(shared=True, idle_chunk=2048)
    assert split is not None and split.cut_ratio == pytest.approx(1.5)  # (1 + 1 + 1 + 3) / 4
    # sized at 2x (the slower half): 2 x (10 + 40) ms = 100 ms beside a 50 ms step
    assert chunks.tokens(decode_step_s=0.05) == 40


def test_a_cut_pass_shorter_than_the_least_chunk_does_not_speak_for_chunks() -> None:
    """1- and 3-token passes beside a decode time the per-pass overhead: read as the speed, they
    sized the next chunks too large for the TBT budget."""
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=Clock())
    for _ in range(4):  # 1-token passes at a third of the model's 11 ms
        chunks.observe([(1, 0)], MODEL.prefill_s(1) / 3, beside_decode=True, wait_s=0.02)
    assert chunks.tokens(decode_step_s=0.05) == 90  # the model's own speed: 50 + 10 + 90 ms
    split = chunks.split(shared=True, idle_chunk=2048)
    assert split is not None and split.cut_ratio == pytest.approx(1.0)
    assert split.wait_s == pytest.approx(0.02)  # their waits for the cores still count
    chunks.observe([(MIN_CHUNK, 0)], 2 * MODEL.prefill_s(MIN_CHUNK), beside_decode=True)
    assert chunks.tokens(decode_step_s=0.05) == 40  # a chunk-sized pass does: 2 x (10 + 40) ms


class Board:
    """Another engine process on the core board: present, busy or not."""

    def __init__(self, present: int, active: int) -> None:
        self.present, self.active = present, active

    def others_active(self) -> int:
        return self.active

    def others_present(self) -> int:
        return self.present


def test_passes_are_cut_while_a_decode_takes_the_job_just_answered() -> None:
    """A pass begun at full size right after a hand-off holds the cores for seconds while the
    decode that took the job waits for its first step; so the next passes stay cut a moment."""
    idle_decode = Board(present=1, active=0)
    assert decode_beside(Board(present=1, active=1), float("-inf"), 100.0)
    assert decode_beside(idle_decode, 99.5, 100.0)  # answered 0.5 s ago: the decode is starting
    assert not decode_beside(idle_decode, 100.0 - HANDOFF_GRACE_S, 100.0)  # it never came
    assert not decode_beside(Board(present=0, active=0), 99.9, 100.0)  # alone on its cores


def test_a_prefill_instance_times_a_pass_long_enough_for_a_bursts_first_pass() -> None:
    """At start-up a prefill instance times a pass of 3/4 of its chunk, so the conductor may
    let a burst's first pass run past one chunk from the first burst on; within the engine's
    limits (half its context, half its KV pool) and never below the usual 512 tokens."""
    assert seed_pass_tokens(2048, 8192, 100_000) == SEED_PASS_TOKENS == 512
    assert seed_pass_tokens(2048, 8192, 100_000, long=True) == 1536
    assert seed_pass_tokens(2048, 2048, 100_000, long=True) == 1024  # half the context
    assert seed_pass_tokens(2048, 8192, 1_000, long=True) == 500  # half the KV pool
    assert seed_pass_tokens(256, 8192, 100_000, long=True) == 256  # at most a chunk


def test_the_rest_of_a_pass_is_timed_at_the_speed_the_last_full_pass_ran() -> None:
    """A long first pass runs as forwards back to back: its rest runs at the speed the host
    has now, which the last forward measured, not at a minute's mean."""
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=Clock())
    assert chunks.rest_s([(100, 0)]) is None  # no full pass timed yet
    chunks.observe([(200, 0)], 2 * MODEL.prefill_s(200))
    chunks.observe([(200, 0)], 1.5 * MODEL.prefill_s(200))
    chunks.observe([(64, 0)], 9 * MODEL.prefill_s(64), beside_decode=True)  # a cut pass
    assert chunks.rest_s([(100, 0), (40, 0)]) == pytest.approx(1.5 * (0.01 + 0.14))
    assert ChunkBudget(256).rest_s([(100, 0)]) is None  # no cost model (no --tbt-slo)


def test_a_prompt_started_now_is_timed_at_the_speed_passes_here_ran() -> None:
    """What the prefill asks before starting a job past its start deadline: how long the prompt
    takes now, in cut passes and their waits beside a decode, whole otherwise; unknown until
    such passes were timed here (the job is then refused, as the conductor's deadline says)."""
    clock = Clock()
    chunks = ChunkBudget(256, MODEL, tbt_slo_s=0.2, clock=clock)
    assert chunks.prompt_s(130, beside_decode=True) is None
    assert chunks.prompt_s(130, beside_decode=False) is None
    for wait in (0.01, 0.03, 0.05, 0.07):
        chunks.observe([(64, 0)], 2 * MODEL.prefill_s(64), wait_s=wait, beside_decode=True)
    assert chunks.prompt_s(130, beside_decode=False) is None  # no whole pass timed yet
    # Chunks of 65 tokens (75 ms modelled, 150 ms at 2x): two passes, each after a 40 ms wait.
    assert chunks.tokens() == 65
    assert chunks.prompt_s(130, beside_decode=True) == pytest.approx(2 * (0.15 + 0.04))
    chunks.observe([(1024, 0)], 1.5 * MODEL.prefill_s(1024))
    assert chunks.prompt_s(130, beside_decode=False) == pytest.approx(1.5 * 0.14)
    clock.now += 61.0  # the cut speed is forgotten: beside a decode it is unknown again
    assert chunks.prompt_s(130, beside_decode=True) is None
    assert ChunkBudget(256).prompt_s(130, beside_decode=False) is None  # no --tbt-slo
