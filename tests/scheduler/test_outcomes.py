"""Each placed request's estimates against what it got: its verdict, the counters, the log line."""

from __future__ import annotations

import logging

import pytest
from sched_helpers import Clock

from mooncake_server.roles.conductor.scheduler.outcomes import (
    OVERRUN_HORIZON_S,
    SECOND_MISSED,
    TBT_MISSED,
    TTFT_MISSED,
    WITHIN,
    RequestOutcomes,
    longest_tenth_mean,
)


def run(outcomes: RequestOutcomes, clock: Clock, rid: str, ttft: float,
        gaps: list[float]) -> str | None:
    outcomes.placed(rid, ttft_estimate_s=0.5, tbt_estimate_s=0.1)
    clock.now += ttft
    outcomes.first_token(rid)
    for gap in gaps:
        clock.now += gap
        outcomes.token(rid)
    return outcomes.finished(rid)


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps() -> None:
    assert longest_tenth_mean([]) is None
    assert longest_tenth_mean([0.1, 0.3]) == pytest.approx(0.3)  # one gap judged at least
    assert longest_tenth_mean([0.05] * 18 + [0.3, 0.5]) == pytest.approx(0.4)  # 2 of 20
    assert longest_tenth_mean([0.05] * 19 + [0.5]) == pytest.approx(0.275)  # ceil(1.9) = 2


def test_each_request_is_judged_against_the_slos_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outcomes = RequestOutcomes(ttft_slo_s=1.0, tbt_slo_s=0.2, clock=clock)
    caplog.set_level(logging.INFO)
    assert run(outcomes, clock, "ok", 0.4, [0.05] * 20) == WITHIN
    # One slow gap in twenty is diluted (judged with the next longest); two are not.
    assert run(outcomes, clock, "one-slow", 0.4, [0.05] * 19 + [0.3]) == WITHIN
    assert run(outcomes, clock, "two-slow", 0.4, [0.05] * 18 + [0.3, 0.3]) == TBT_MISSED
    assert run(outcomes, clock, "late", 1.5, [0.05] * 5) == TTFT_MISSED
    assert outcomes.counts == {WITHIN: 2, TBT_MISSED: 1, TTFT_MISSED: 1}
    line = next(r.getMessage() for r in caplog.records if "two-slow" in r.getMessage())
    assert "TTFT 0.40 s (estimated 0.50)" in line and "TBT 300 ms (estimated 100 ms)" in line
    assert list(outcomes.ratios["ttft"]) == pytest.approx([0.8, 0.8, 0.8, 3.0])


def test_the_hand_off_is_time_to_the_second_token_not_a_tbt_gap() -> None:
    """The gap before the second token is the KV hand-off: a slow one is judged against TTFT
    + TBT (1.2 s here), never as a decode step."""
    clock = Clock()
    outcomes = RequestOutcomes(ttft_slo_s=1.0, tbt_slo_s=0.2, clock=clock)
    assert run(outcomes, clock, "two-tokens", 0.4, [0.7]) == WITHIN  # second token at 1.1 s
    assert run(outcomes, clock, "slow-hand-off", 0.4, [0.7] + [0.05] * 5) == WITHIN
    assert run(outcomes, clock, "late-second", 0.4, [0.9] + [0.05] * 5) == SECOND_MISSED
    assert outcomes.counts == {WITHIN: 2, SECOND_MISSED: 1}


def test_a_request_that_never_got_a_token_is_not_judged() -> None:
    clock = Clock()
    outcomes = RequestOutcomes(ttft_slo_s=1.0, tbt_slo_s=0.2, clock=clock)
    outcomes.placed("failed", 0.5, 0.1)
    clock.now += 3.0
    assert outcomes.finished("failed") is None
    assert outcomes.finished("never-placed") is None
    assert not outcomes.counts


def test_overrun_is_the_most_a_long_ttft_estimate_ran_over_lately() -> None:
    """Only estimates of half the SLO or more count (short ones read the per-pass constants,
    not the host's speed), and only for OVERRUN_HORIZON_S."""
    clock = Clock()
    outcomes = RequestOutcomes(ttft_slo_s=1.0, tbt_slo_s=0.2, clock=clock)
    assert outcomes.overrun() is None

    def ttft(rid: str, estimate: float, measured: float) -> None:
        outcomes.placed(rid, ttft_estimate_s=estimate, tbt_estimate_s=0.1)
        clock.now += measured
        outcomes.first_token(rid)
        outcomes.finished(rid)

    ttft("short", 0.4, 0.8)  # 2x, but under half the SLO
    assert outcomes.overrun() is None
    ttft("long", 0.5, 0.55)
    ttft("longer", 0.8, 0.72)
    assert outcomes.overrun() == pytest.approx(1.1)
    clock.now += OVERRUN_HORIZON_S
    assert outcomes.overrun() is None
