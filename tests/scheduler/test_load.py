"""The ledger: prefill queues drain as first tokens arrive, calibration, heartbeats as a floor."""

from __future__ import annotations

import pytest
from sched_helpers import Clock

from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.wire.instances import Heartbeat


def test_queue_is_the_sum_of_queued_estimates_minus_progress() -> None:
    clock = Clock()
    t = LoadTracker(clock)
    t.assign("a", "p1", 2.0, "d1", 100)
    t.assign("b", "p1", 1.0, "d1", 50)
    assert t.prefill_queue_s("p1") == pytest.approx(3.0)
    clock.now += 0.5  # a has run for half a second
    assert t.prefill_queue_s("p1") == pytest.approx(2.5)
    clock.now += 1.5
    t.prefill_done("a")  # on time: calibration stays 1
    assert t.calibration("p1") == pytest.approx(1.0)
    assert t.prefill_queue_s("p1") == pytest.approx(1.0)
    assert t.prefill_queue_s("p2") == 0.0


def test_slow_prefills_raise_later_estimates() -> None:
    clock = Clock()
    t = LoadTracker(clock)
    for i in range(5):
        t.assign(f"r{i}", "p1", 1.0, "d1", 10)
        clock.now += 3.0  # every prefill takes 3x the model's estimate
        t.prefill_done(f"r{i}")
    assert t.calibration("p1") > 2.0
    t.assign("next", "p1", 1.0, "d1", 10)
    assert t.prefill_queue_s("p1") > 2.0


def test_decode_batch_follows_requests_and_tokens() -> None:
    t = LoadTracker(Clock())
    t.assign("a", "p1", 1.0, "d1", 100)
    t.assign("b", "p1", 1.0, "d1", 50)
    t.token("a")
    assert t.decode_load("d1") == (2, 151)
    t.finished("a")
    assert t.decode_load("d1") == (1, 50)
    t.finished("b")
    assert t.decode_load("d1") == (0, 0) and t.in_flight() == 0
    assert t.prefill_queue_s("p1") == 0.0


def test_heartbeat_reporting_more_work_raises_the_estimate() -> None:
    t = LoadTracker(Clock())
    t.assign("a", "p1", 1.0, "d1", 100)
    beat = Heartbeat(instance_id="p1", waiting=3)
    assert t.prefill_queue_s("p1", beat) == pytest.approx(3.0)
    assert t.prefill_queue_len("p1", beat) == 3
    assert t.decode_load("d1", Heartbeat(instance_id="d1", running=4)) == (4, 400)
    # A beat reporting less than the ledger never lowers it (it may predate our requests).
    assert t.prefill_queue_s("p1", Heartbeat(instance_id="p1", waiting=0)) == pytest.approx(1.0)


def test_a_heartbeat_does_not_count_the_work_that_left_after_it() -> None:
    """A beat sent while requests ran still counts them once they are done (beats come about
    once a second): what the ledger saw leave since the beat is taken off its count, and the
    next beat counts afresh."""
    t = LoadTracker(Clock())
    t.assign("a", "p1", 1.0, "d1", 100)
    t.assign("b", "p1", 1.0, "d1", 100)
    t.heard("p1")
    t.heard("d1")
    prefill_beat, decode_beat = (Heartbeat(instance_id="p1", waiting=3),
                                 Heartbeat(instance_id="d1", running=3))
    t.prefill_done("a")
    # One of the three the prefill reported left since: two remain (b, and one not ours).
    assert t.prefill_queue_len("p1", prefill_beat) == 2
    assert t.prefill_queue_s("p1", prefill_beat) == pytest.approx(2.0)
    t.finished("a")
    t.finished("b")
    assert t.decode_load("d1", decode_beat) == (1, 0)  # the one not ours
    assert t.prefill_queue_len("p1", prefill_beat) == 1
    t.heard("d1")  # a fresh beat: its own count, whole
    assert t.decode_load("d1", Heartbeat(instance_id="d1", running=1)) == (1, 0)
    assert t.decode_load("d1", Heartbeat(instance_id="d1", running=0)) == (0, 0)


def test_slow_decode_steps_raise_tbt_estimates() -> None:
    clock = Clock()
    t = LoadTracker(clock)
    t.assign("a", "p1", 1.0, "d1", 100)
    t.prefill_done("a")
    t.token("a", 0.05)  # first decoded token: its gap includes loading KV, not counted
    for _ in range(60):
        clock.now += 0.2  # steps take 4x the modelled 50 ms (a busy shared CPU)
        t.token("a", 0.05)
    assert t.decode_calibration("d1") == pytest.approx(4.0)
    assert t.decode_calibration("d2") == 1.0


def test_an_idle_instance_forgets_what_an_overload_measured() -> None:
    clock = Clock()
    t = LoadTracker(clock, horizon_s=10.0)
    for i in range(5):  # prefills 3x slower than modelled, hand-offs of 0.5 s
        t.assign(f"r{i}", "p1", 1.0, "d1", 100)
        clock.now += 3.0
        t.prefill_done(f"r{i}")
        clock.now += 0.5
        t.token(f"r{i}", 0.025)
        for _ in range(10):  # steps 4x the model
            clock.now += 0.1
            t.token(f"r{i}", 0.025)
        t.finished(f"r{i}")
    assert t.calibration("p1") > 2.0
    assert t.decode_calibration("d1") == pytest.approx(4.0)
    assert t.handoff_s("d1") == pytest.approx(0.5)
    clock.now += 10.0  # nothing admitted since: nothing measured
    assert t.calibration("p1") == 1.0
    assert t.decode_calibration("d1") == 1.0
    assert t.handoff_s("d1") == 0.0
    t.assign("next", "p1", 1.0, "d1", 10)
    assert t.prefill_queue_s("p1") == pytest.approx(1.0)  # the model's estimate again


def test_prefills_answered_by_one_batched_pass_calibrate_as_one() -> None:
    """The worker batches a queue: 4 jobs of 1 s estimated done in one 2 s pass = 0.5x, not 2x
    for the head (and 0.25x, the clamp, for each job answered right after it)."""
    clock = Clock()
    t = LoadTracker(clock)
    for i in range(4):
        t.assign(f"r{i}", "p1", 1.0, "d1", 10)
    clock.now += 2.0
    for i in range(4):
        t.prefill_done(f"r{i}")
        clock.now += 0.001
    clock.now += 1.0
    assert t.calibration("p1") == pytest.approx(1.0 + 0.3 * (2.003 / 4.0 - 1.0), rel=1e-3)
    t.assign("next", "p1", 1.0, "d1", 10)
    assert t.prefill_queue_s("p1") < 1.0


def test_decode_steps_left_counts_each_requests_tokens_per_choice() -> None:
    """The prefill makes each choice's first token; every token the decode streams after it
    counts once, a request with n choices streaming n per step."""
    t = LoadTracker()
    assert t.decode_steps_left("d1") == 0
    t.assign("one", "p1", 0.1, "d1", 10, max_tokens=5)
    t.assign("two", "p1", 0.1, "d1", 10, max_tokens=4, choices=2)
    assert t.decode_steps_left("d1") == 4
    for _ in range(3):
        t.token("one")
        t.token("two")
    assert t.decode_steps_left("d1") == 2  # "two": 6 - 3 tokens = 2 steps of 2 choices
    assert t.decode_steps_left("d1", excluding={"two"}) == 1
    t.assign("unknown", "p1", 0.1, "d1", 10)
    assert t.decode_steps_left("d1") is None
    t.finished("unknown")
    assert t.decode_steps_left("d1") == 2


def test_a_held_hand_off_is_timed_from_when_the_prefill_sent_it_on() -> None:
    """A prefill that held a request's hand-off while prompts behind it ran (prefill/hand_on.py)
    sends it on 4 s after its first token; the decode then starts it in 60 ms. Timed from the
    first token, every later request would be judged to reach its second token 4 s late."""
    clock = Clock()
    t = LoadTracker(clock, horizon_s=10.0)
    t.assign("r", "p1", 1.0, "d1", 100)
    clock.now += 0.2
    t.prefill_done("r")
    clock.now += 4.0
    t.handed_on("r")
    clock.now += 0.06
    t.token("r", 0.025)
    assert t.handoff_s("d1") == pytest.approx(0.06)
