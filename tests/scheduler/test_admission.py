"""Decode admission control: KV memory and predicted TBT decide whether a request is taken."""

from __future__ import annotations

import pytest
from sched_helpers import MODEL, Clock

from mooncake_server.roles.decode.admission import AdmissionRefused, DecodeAdmission


def admission(blocks: int = 10, tbt_slo: float | None = None,
              clock: Clock | None = None) -> DecodeAdmission:
    # 4-token blocks; MODEL: a step is 20 ms + 5 ms per sequence.
    return DecodeAdmission(blocks, 4, 64, model=MODEL, tbt_slo_s=tbt_slo, ttl_s=30.0,
                           clock=clock or Clock())


def test_refuses_what_the_kv_memory_could_not_finish() -> None:
    a = admission(blocks=10)
    a.reserve("r1", prompt_tokens=12, max_tokens=8)  # 5 blocks, worst case
    a.reserve("r2", prompt_tokens=12, max_tokens=8)
    with pytest.raises(AdmissionRefused, match="KV memory"):
        a.reserve("r3", prompt_tokens=1, max_tokens=1)
    a.release("r1")
    a.reserve("r3", prompt_tokens=1, max_tokens=1)
    assert a.committed_blocks == 6


def test_an_idle_instance_takes_even_a_request_larger_than_its_pool() -> None:
    a = admission(blocks=2)
    a.reserve("big", prompt_tokens=40, max_tokens=30)  # capped at the 64-token context
    assert a.committed_blocks == 16


def test_refuses_what_would_break_the_tbt_slo() -> None:
    a = admission(blocks=1000, tbt_slo=0.036)  # 20 ms + 5 ms x 3 = 35 ms fits, 4 do not
    for rid in ("a", "b", "c"):
        a.reserve(rid, prompt_tokens=4, max_tokens=4)
    with pytest.raises(AdmissionRefused, match="TBT"):
        a.reserve("d", prompt_tokens=4, max_tokens=4)
    assert a.refused == 1


def test_measured_steps_calibrate_the_tbt_prediction() -> None:
    a = admission(blocks=1000, tbt_slo=0.1)
    a.reserve("a", prompt_tokens=4, max_tokens=4)
    a.reserve("b", prompt_tokens=4, max_tokens=4)  # 30 ms predicted: fits
    for _ in range(100):
        a.observe_step(batch=2, context=8, compute_s=0.12)  # this host runs steps 4x slower
    with pytest.raises(AdmissionRefused, match="TBT"):
        a.reserve("c", prompt_tokens=4, max_tokens=4)


def test_a_job_claims_its_reservation_and_unclaimed_ones_expire() -> None:
    clock = Clock()
    a = admission(blocks=10, clock=clock)
    a.reserve("r1", prompt_tokens=12, max_tokens=8)
    a.claim("r1", prompt_tokens=12, max_tokens=8)  # no double count
    a.reserve("r2", prompt_tokens=12, max_tokens=8)
    assert a.committed_blocks == 10
    clock.now += 31  # r2's decode job never came; r1 is claimed and stays
    assert a.committed_blocks == 5
    a.claim("r3", prompt_tokens=12, max_tokens=8)  # a job without a reservation
    finished = False
    a.bind("r3", lambda: finished)
    finished = True  # its stream ended without a release
    assert a.committed_blocks == 5


def test_calibration_budgets_for_the_slow_tail_of_steps() -> None:
    from mooncake_server.cost_model.calibration import TailCalibration

    cal = TailCalibration()
    assert cal.value == 1.0
    for i in range(100):  # most steps as modelled, one in five 3x slower (a prefill nearby)
        cal.add(0.3 if i % 5 == 0 else 0.1, 0.1)
    assert cal.value == pytest.approx(3.0)  # TBT is judged on the longest gaps


def test_slow_steps_stop_counting_once_the_instance_ran_none_for_the_horizon() -> None:
    clock = Clock()
    a = DecodeAdmission(1000, 4, 64, model=MODEL, tbt_slo_s=0.1, horizon_s=10.0, clock=clock)
    a.reserve("a", prompt_tokens=4, max_tokens=4)
    for _ in range(100):
        a.observe_step(batch=1, context=4, compute_s=0.5)  # an overload: steps 20x the model
    with pytest.raises(AdmissionRefused, match="TBT"):
        a.reserve("b", prompt_tokens=4, max_tokens=4)
    clock.now += 10.0  # "a" waits for its decode job; no step ran since
    a.reserve("b", prompt_tokens=4, max_tokens=4)  # 30 ms as modelled
    assert a.calibration == 1.0


def test_an_idle_instance_predicts_from_its_quiet_step_not_the_bare_model() -> None:
    """Its first requests are judged on the step it timed at start-up: on the bare model (a
    step of three is 35 ms) the third would be refused under a 30 ms SLO."""
    a = admission(blocks=1000, tbt_slo=0.03)
    a.seed_quiet_step(1, 4, 0.0125)  # half the model's 25 ms
    for rid in "abc":
        a.reserve(rid, prompt_tokens=4, max_tokens=4)
    assert a.predicted_step_s(3, 12) == pytest.approx(0.0175)


def test_a_wait_for_the_cores_is_added_to_a_step_not_scaled_with_the_batch() -> None:
    """A prefill pass beside the decode lengthens every gap by its own time, whatever the batch:
    read as a ratio, a pass beside a one-sequence step made a batch of three look unservable."""
    clock = Clock()
    a = admission(blocks=1000, tbt_slo=0.1, clock=clock)
    a.reserve("a", prompt_tokens=4, max_tokens=4)
    for _ in range(50):
        a.observe_step(batch=1, context=4, compute_s=0.025, wait_s=0.062)  # a pass each step
    a.reserve("b", prompt_tokens=4, max_tokens=4)
    a.reserve("c", prompt_tokens=4, max_tokens=4)  # 35 ms step + 62 ms wait: fits 100 ms
    assert a.predicted_step_s(3, 12) == pytest.approx(0.097, abs=1e-3)
    with pytest.raises(AdmissionRefused, match="TBT"):
        a.reserve("d", prompt_tokens=4, max_tokens=4)  # 40 + 62 ms does not
    clock.now += 10.0  # the prompts are done: the waits age out with the steps
    assert a.wait_s == 0.0
    a.reserve("d", prompt_tokens=4, max_tokens=4)


def test_it_reports_its_steps_mean_ratio_beside_the_slow_tail() -> None:
    """The heartbeat carries both: TBT is judged by the slow tail, a prompt's many passes
    beside the steps by their mean."""
    a = admission(tbt_slo=1.0)
    assert a.mean_step_ratio() == 1.0  # nothing measured: the model's own steps
    for i in range(100):  # one step in ten 3x slower than the model (25 ms at batch 1)
        a.observe_step(batch=1, context=4, compute_s=0.075 if i % 10 == 0 else 0.025)
    assert a.calibration == pytest.approx(3.0)
    assert a.mean_step_ratio() == pytest.approx(1.2)
