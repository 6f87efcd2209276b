"""Calibrations forget by time: an overload's slow measurements do not outlive it."""

from __future__ import annotations

import pytest
from sched_helpers import Clock

from mooncake_server.cost_model.calibration import (
    GapTailCalibration,
    SmoothedCalibration,
    TailCalibration,
    TailMeanCalibration,
)


def test_the_tail_forgets_slow_steps_once_they_are_older_than_the_horizon() -> None:
    clock = Clock()
    cal = TailCalibration(horizon_s=10.0, clock=clock)
    for _ in range(256):  # an overload: the window full of steps 20x the model
        cal.add(2.0, 0.1)
    assert cal.value == pytest.approx(20.0)
    clock.now += 9.9  # idle: rejected requests measure nothing
    assert cal.value == pytest.approx(20.0)
    clock.now += 0.1
    assert cal.value == 1.0  # back on the model


def test_the_tail_is_taken_over_recent_samples_only() -> None:
    clock = Clock()
    cal = TailCalibration(horizon_s=10.0, clock=clock)
    for _ in range(100):
        cal.add(0.5, 0.1)  # the overload's steps, 5x the model
    clock.now += 6.0
    for _ in range(20):
        cal.add(0.1, 0.1)  # a few requests since, as modelled
    assert cal.value == pytest.approx(5.0)  # the old ones still dominate the tail
    clock.now += 4.0
    assert cal.value == pytest.approx(1.0)  # only the recent ones are left


def test_the_tail_keeps_its_quantile_and_clamp() -> None:
    cal = TailCalibration(clock=Clock())
    for i in range(100):  # one step in five 3x slower
        cal.add(0.3 if i % 5 == 0 else 0.1, 0.1)
    assert cal.value == pytest.approx(3.0)
    cal.add(100.0, 0.1)
    cal.add(0.0, 0.1)
    cal.add(1.0, 0.0)  # nothing modelled: ignored
    assert cal.value == pytest.approx(3.0)
    top = TailCalibration(quantile=1.0, clock=Clock())
    top.add(100.0, 0.1)
    assert top.value == 30.0


def test_the_smoothed_average_is_the_old_one_while_samples_are_recent() -> None:
    clock = Clock()
    cal = SmoothedCalibration(horizon_s=10.0, clock=clock)
    expected = 1.0
    for ratio in (3.0, 3.0, 0.1, 20.0, 2.0):
        clock.now += 1.0
        cal.add(ratio, 1.0)
        clamped = min(8.0, max(0.25, ratio))
        expected += 0.3 * (clamped - expected)
        assert cal.value == pytest.approx(expected)


def test_the_smoothed_average_forgets_old_samples() -> None:
    clock = Clock()
    cal = SmoothedCalibration(horizon_s=10.0, clock=clock)
    for _ in range(20):
        cal.add(8.0, 1.0)
    assert cal.value > 7.9
    clock.now += 5.0
    cal.add(2.0, 1.0)
    clock.now += 5.0  # the first twenty are gone; the average restarts from the model
    assert cal.value == pytest.approx(1.0 + 0.3 * (2.0 - 1.0))
    clock.now += 5.0
    assert cal.value == 1.0


@pytest.mark.parametrize("make", [TailCalibration, SmoothedCalibration])
def test_a_horizon_must_be_positive(make: type) -> None:
    with pytest.raises(ValueError, match="horizon_s"):
        make(horizon_s=0.0)



def test_the_tail_mean_reads_a_long_tail_as_the_slo_judges_it() -> None:
    """Gaps: 90% as modelled, the slowest tenth 2x..20x: a request like them is judged by
    the mean of its slowest tenth (11x), which the 90th percentile (2x) under-reads."""
    quantile, mean = TailCalibration(clock=Clock()), TailMeanCalibration(clock=Clock())
    tail = [2.0 * (i + 1) for i in range(10)]  # 2, 4, ..., 20
    for ratio in [1.0] * 90 + tail:
        quantile.add(ratio, 1.0)
        mean.add(ratio, 1.0)
    assert quantile.value == pytest.approx(2.0)
    assert mean.value == pytest.approx(sum(tail) / len(tail))


def test_a_gap_tail_counts_a_slow_step_and_a_long_wait_only_when_they_came_together() -> None:
    """A tenth of the gaps wait 100 ms behind a prefill pass, another tenth are 3x slow steps
    (a neighbour on the cores): no gap had both, so none took 160 ms."""
    cal = GapTailCalibration(clock=Clock())
    for i in range(100):
        slow, waited = i % 10 == 5, i % 10 == 0
        cal.add(0.06 if slow else 0.02, 0.02, wait_s=0.1 if waited else 0.0)
    assert cal.split(0.02) == pytest.approx((1.0, 0.1))
    assert cal.predict(0.02) == pytest.approx(0.12)
    # A step modelled 10x longer: the slow steps are the tail now, and the wait is not scaled.
    assert cal.predict(0.2) == pytest.approx(0.6)


def test_many_steps_run_at_the_mean_ratio_where_one_gap_is_judged_by_the_tail() -> None:
    """A prompt's cut passes wait for dozens of steps: their sum runs at the mean of the
    steps' ratios, not at the slow tail a single gap (TBT) is judged by."""
    clock = Clock()
    cal = GapTailCalibration(horizon_s=10.0, clock=clock)
    cal.seed_quiet(0.01, 0.02)
    assert cal.mean_ratio() == pytest.approx(0.5)  # nothing recent: the quiet step
    for i in range(100):
        cal.add(0.06 if i % 10 == 5 else 0.02, 0.02)  # one step in ten 3x slow
    assert cal.split(0.02)[0] == pytest.approx(3.0)
    assert cal.mean_ratio() == pytest.approx(1.2)
    clock.now += 10.0
    assert cal.mean_ratio() == pytest.approx(0.5)


def test_a_gap_tail_forgets_by_time() -> None:
    clock = Clock()
    cal = GapTailCalibration(horizon_s=10.0, clock=clock)
    assert cal.split(0.05) == (1.0, 0.0)
    for _ in range(50):
        cal.add(1.0, 0.05, wait_s=0.5)  # an overload
    assert cal.predict(0.05) == pytest.approx(1.5)
    clock.now += 10.0
    assert cal.recent == 0
    assert cal.predict(0.05) == pytest.approx(0.05)  # back on the model


def test_a_gap_tail_falls_back_on_the_quiet_step_timed_at_start_up() -> None:
    """The built-in model is another machine's: an idle instance predicts from its own step."""
    clock = Clock()
    cal = GapTailCalibration(horizon_s=10.0, clock=clock)
    cal.seed_quiet(0.015, 0.045)  # a third of the model here
    assert cal.split(0.09) == pytest.approx((1 / 3, 0.0))
    for _ in range(50):
        cal.add(0.09, 0.045, wait_s=0.1)  # load
    assert cal.predict(0.045) == pytest.approx(0.19)
    clock.now += 10.0
    assert cal.predict(0.045) == pytest.approx(0.015)  # back on the quiet step, not the model
    cal.seed_quiet(0.001, 0.045)
    assert cal.split(0.045)[0] == 0.1  # clamped as every ratio is


def test_the_weighted_mean_is_what_passes_like_the_recent_ones_take_together() -> None:
    """Two 2-second passes at 1.5x their model and four 1-token passes at 0.4x: a sum of
    passes like them takes 1.49x, where the plain mean of the ratios says 0.77x."""
    clock = Clock()
    cal = TailMeanCalibration(quantile=0.5, clock=clock)
    for measured, modelled in [(3.0, 2.0), (3.0, 2.0)] + [(0.02, 0.05)] * 4:
        cal.add(measured, modelled)
    assert cal.mean == pytest.approx((1.5 + 1.5 + 4 * 0.4) / 6)
    assert cal.weighted_mean == pytest.approx(6.08 / 4.2)
    clock.now += 11.0  # past the horizon: the model's own times
    assert cal.weighted_mean == 1.0
