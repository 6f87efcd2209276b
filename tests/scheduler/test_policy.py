"""Algorithm 1 on synthetic clusters: cache affinity, load balance, SLO early rejection, policies."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
from sched_helpers import BT, MODEL, Clock, cluster, request

from mooncake_server.config import POLICIES
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.roles.conductor.scheduler.oracle import STORE_WIDE
from mooncake_server.roles.conductor.scheduler.policy import (
    KVCacheScheduler,
    Plan,
    Policy,
    SLORejected,
)
from mooncake_server.wire.instances import Heartbeat, PassSplit


class Hits:
    """A prefix oracle answering from a fixed table."""

    def __init__(self, table: dict[str, int]) -> None:
        self.table = table
        self.asked = 0

    async def longest_prefix(self, keys: list[str]) -> dict[str, int]:
        self.asked += 1
        return dict(self.table)


def scheduler(policy: str, hits: dict[str, int] | None = None, *, prefill: int = 2,
              decode: int = 2, ttft_slo: float | None = None, tbt_slo: float | None = None,
              seed: int = 0, clock: Clock | None = None) -> KVCacheScheduler:
    clock = clock or Clock()
    return KVCacheScheduler(cluster(prefill, decode, clock=clock), MODEL, policy=policy,
                            block_tokens=BT, oracle=Hits(hits or {}), ttft_slo_s=ttft_slo,
                            tbt_slo_s=tbt_slo, tracker=LoadTracker(clock),
                            rng=random.Random(seed))


def keys(n_tokens: int) -> list[str]:
    return [f"k{i}" for i in range(n_tokens // BT)]


def test_policy_names_match_the_flag() -> None:
    assert {p.value for p in Policy} == set(POLICIES)


@pytest.mark.parametrize("policy", ["cache-local", "cache-global"])
async def test_prefers_the_instance_holding_the_prefix(policy: str) -> None:
    s = scheduler(policy, {"p2": 60, STORE_WIDE: 60})
    plan = await s.plan(request("r", 1000), keys(1000))
    assert plan is not None and plan.prefill.instance_id == "p2"
    assert plan.prefill_estimate.reused_tokens == 60 * BT
    assert plan.prefill_estimate.fetched_tokens == 0


async def test_global_policy_sends_work_off_an_overloaded_holder_and_fetches() -> None:
    s = scheduler("cache-global", {"p1": 60, STORE_WIDE: 60})
    # p1 holds the prefix but has 5 s of prefill queued; p2 is idle.
    s.tracker.assign("busy", "p1", 5.0, "d1", 10)
    plan = await s.plan(request("r", 1000), keys(1000))
    assert plan is not None and plan.prefill.instance_id == "p2"
    assert plan.prefill_estimate.fetched_tokens == 60 * BT  # p2 pulls it from the store
    assert plan.prefill_estimate.ttft_s < 1.0


async def test_local_policy_recomputes_instead_of_fetching() -> None:
    s = scheduler("cache-local", {"p1": 60, STORE_WIDE: 60})
    s.tracker.assign("busy", "p1", 5.0, "d1", 10)
    plan = await s.plan(request("r", 1000), keys(1000))
    assert plan is not None and plan.prefill.instance_id == "p2"
    assert plan.prefill_estimate.reused_tokens == 0  # only p1's own cache counts


async def test_placements_spread_as_the_queue_builds() -> None:
    s = scheduler("cache-global")
    picked = Counter()
    for i in range(10):
        plan = await s.plan(request(f"r{i}", 500), keys(500))
        assert plan is not None
        picked[plan.prefill.instance_id] += 1
    assert picked == {"p1": 5, "p2": 5}


async def test_rejects_at_once_when_ttft_slo_cannot_be_met() -> None:
    s = scheduler("cache-global", ttft_slo=1.0)
    for iid in ("p1", "p2"):
        s.tracker.assign(f"busy-{iid}", iid, 3.0, "d1", 10)
    with pytest.raises(SLORejected) as err:
        await s.plan(request("r", 200), keys(200))
    assert err.value.status == 429
    assert err.value.retry_after_s == 3  # ~2.2 s over the SLO, rounded up
    assert "TTFT" in str(err.value) and "--ttft-slo" in str(err.value)
    assert s.rejected == 1 and s.tracker.in_flight() == 2  # nothing was queued for it


async def test_accepts_when_one_instance_can_meet_the_slo() -> None:
    s = scheduler("cache-global", ttft_slo=1.0)
    s.tracker.assign("busy", "p1", 3.0, "d1", 10)
    plan = await s.plan(request("r", 200), keys(200))
    assert plan is not None and plan.prefill.instance_id == "p2"


async def test_rejects_when_tbt_slo_cannot_be_met() -> None:
    s = scheduler("cache-global", tbt_slo=0.1, decode=1)
    for i in range(15):
        s.tracker.assign(f"run{i}", "p1", 0.0, "d1", 100)
    # A batch of 16 steps in 20 + 16 × 5 = 100 ms, at the SLO; a 17th would make it 105 ms.
    await s.plan(request("ok", 100), keys(100))
    with pytest.raises(SLORejected, match="TBT"):
        await s.plan(request("r", 100), keys(100))


async def test_measured_hand_offs_are_budgeted_as_time_to_the_second_token() -> None:
    """Slow hand-offs (KV load, joining a busy batch) are learnt, and judged against TTFT +
    TBT (the second token's budget), never as a decode step: steady steps meet the TBT SLO."""
    clock = Clock()  # the ledger's own, so instances' heartbeats stay fresh
    s = scheduler("cache-global", ttft_slo=0.2, tbt_slo=0.1, decode=1)
    s.tracker = LoadTracker(clock)
    plan = await s.plan(request("fits", 100), keys(100))  # 110 ms + hand-off 2 x 25 ms
    assert plan is not None and plan.tbt_s == pytest.approx(0.025)
    _learn_slow_hand_offs(s, clock, "d1")  # earlier requests each waited 10 modelled steps
    s.release("fits")
    with pytest.raises(SLORejected, match="second token 0.36 s"):  # 110 + 250 ms > 300 ms
        await s.plan(request("r", 100), keys(100))
    plan = await s.plan(request("one-token", 100, max_tokens=1), keys(100))  # no second token
    assert plan is not None


def _learn_slow_hand_offs(s: KVCacheScheduler, clock: Clock, decode_id: str) -> None:
    for i in range(20):  # each waited 250 ms (10 modelled steps) for its first decode step
        rid = f"slow{i}"
        s.tracker.assign(rid, "p1", 0.0, decode_id, 100)
        s.tracker.prefill_done(rid)
        clock.now += 0.25
        s.tracker.token(rid, 0.025)
        s.tracker.finished(rid)


async def test_a_restarted_decode_instance_is_not_judged_by_its_dead_process() -> None:
    """An instance that earned a slow calibration (say, a cold start) and was restarted gets
    work again: a new process re-registers with a new incarnation and starts uncalibrated."""
    clock = Clock()
    s = scheduler("cache-global")
    s.tracker = LoadTracker(clock)
    d2 = s.registry.get("d2")
    assert d2 is not None
    s.registry.register(d2.model_copy(update={"incarnation": "first"}))
    _learn_slow_hand_offs(s, clock, "d2")
    s.tracker.assign("busy", "p1", 0.0, "d1", 100)  # d1 is busier, yet faster as measured
    plan = await s.plan(request("r1", 100), keys(100))
    assert plan is not None and plan.decode.instance_id == "d1"
    # The conductor forgot and re-learnt the same process: its measurements still hold.
    s.registry.register(d2.model_copy(update={"incarnation": "first"}))
    plan = await s.plan(request("r2", 100), keys(100))
    assert plan is not None and plan.decode.instance_id == "d1"
    # A new process under the same id: measured afresh, and the idler instance wins.
    s.registry.register(d2.model_copy(update={"incarnation": "second"}))
    plan = await s.plan(request("r3", 100), keys(100))
    assert plan is not None and plan.decode.instance_id == "d2"


async def test_decode_goes_to_the_lowest_tbt_with_room() -> None:
    s = scheduler("cache-global")
    s.tracker.assign("a", "p1", 0.0, "d1", 100)
    plan = await s.plan(request("r", 100), keys(100))
    assert plan is not None and plan.decode.instance_id == "d2"
    # d2 reports too little free KV memory for the request: d1 it is.
    s.registry.heartbeat(Heartbeat(instance_id="d2", free_blocks=1))
    plan = await s.plan(request("r2", 100), keys(100))
    assert plan is not None and plan.decode.instance_id == "d1"


async def test_load_policy_ignores_caches_and_picks_the_shortest_queue() -> None:
    s = scheduler("load", {"p1": 60, STORE_WIDE: 60})
    s.tracker.assign("busy", "p1", 0.5, "d1", 10)
    plan = await s.plan(request("r", 1000), keys(1000))
    assert plan is not None and plan.prefill.instance_id == "p2"
    assert plan.decode.instance_id == "d2"


async def test_random_policy_uses_every_instance() -> None:
    s = scheduler("random", {"p1": 60, STORE_WIDE: 60}, prefill=3, decode=3, seed=1)
    seen_p, seen_d = set(), set()
    for i in range(40):
        plan = await s.plan(request(f"r{i}", 300), keys(300))
        assert plan is not None
        seen_p.add(plan.prefill.instance_id)
        seen_d.add(plan.decode.instance_id)
        s.release(f"r{i}")
    assert seen_p == {"p1", "p2", "p3"} and seen_d == {"d1", "d2", "d3"}


async def test_the_plan_carries_the_store_prefix_and_release_forgets_the_request() -> None:
    s = scheduler("cache-global", {"s1": 10, STORE_WIDE: 12})
    plan = await s.plan(request("r", 300), keys(300))
    assert plan is not None and plan.cached_blocks == 12  # the request path counts these hits
    assert s.tracker.in_flight() == 1
    s.release("r")
    assert s.tracker.in_flight() == 0


async def test_missing_role_means_no_plan() -> None:
    s = KVCacheScheduler(cluster(prefill=0), MODEL, block_tokens=BT)
    assert await s.plan(request("r", 100), keys(100)) is None


async def test_hand_off_rejections_end_once_the_overload_measurements_age_out() -> None:
    """An overload taught the ledger slow hand-offs; the retries it refuses measure nothing, so
    only time can clear them: once the last one is a horizon old, the model decides again."""
    clock = Clock()
    s = scheduler("cache-global", ttft_slo=0.2, tbt_slo=0.1, decode=1)
    s.tracker = LoadTracker(clock, horizon_s=10.0)
    _learn_slow_hand_offs(s, clock, "d1")
    last_measured = clock.now
    for i in range(5):  # an idle cluster, clients retrying after Retry-After
        with pytest.raises(SLORejected, match="second token"):
            await s.plan(request(f"retry{i}", 100), keys(100))
        clock.now += 1.0
    clock.now = last_measured + 10.0
    plan = await s.plan(request("r", 100), keys(100))
    assert plan is not None and plan.tbt_s == pytest.approx(0.025)  # one sequence, as modelled


async def test_a_two_token_answer_is_not_judged_by_its_hand_off() -> None:
    """A two-token answer's only gap is its hand-off: it is time to the second token, so on an
    idle cluster it never makes the TBT estimate of the next request (issue 30: 273 ms)."""
    clock = Clock()
    s = scheduler("cache-global", ttft_slo=5.0, tbt_slo=0.2, decode=1, clock=clock)
    plan = await s.plan(request("first", 100, max_tokens=2), keys(100))
    assert plan is not None
    s.first_token("first")
    clock.now += 0.519  # KV hand-off to the decode
    s.token("first")
    s.release("first")
    plan = await s.plan(request("next", 100, max_tokens=64), keys(100))
    assert plan is not None and plan.tbt_s == pytest.approx(0.025)


async def test_a_decode_instances_wait_for_the_cores_is_added_to_its_steps() -> None:
    """A decode beside a prefill on one machine reports its steps' speed and its wait for the
    cores apart: the wait lengthens every gap by the same seconds, whatever the batch."""
    s = scheduler("cache-global", tbt_slo=0.1, decode=1)
    for i in range(2):
        s.tracker.assign(f"run{i}", "p1", 0.0, "d1", 100)
    s.registry.heartbeat(Heartbeat(instance_id="d1", running=2, step_ratio=1.0, wait_s=0.03))
    # A batch of 3: 35 ms + 30 ms waited (a ratio of the one-sequence step would say 80 ms).
    plan = await s.plan(request("ok", 100, max_tokens=64), keys(100))
    assert plan is not None and plan.tbt_s == pytest.approx(0.065)
    s.registry.heartbeat(Heartbeat(instance_id="d1", running=3, step_ratio=1.0, wait_s=0.07))
    with pytest.raises(SLORejected, match="TBT"):  # 40 + 70 ms
        await s.plan(request("r", 100, max_tokens=64), keys(100))


async def test_a_prefill_beside_a_busy_decode_is_judged_by_its_own_passes() -> None:
    """A prefill instance that cuts its passes beside a decode on its cores (--tbt-slo, one
    machine) says how they go: a prompt that fits the TTFT SLO at full speed is rejected while
    a decode there has work, since each cut pass waits for a decode step; a one-pass prompt
    still gets in, estimated exactly, and an idle machine takes the long prompt."""
    s = scheduler("cache-global", ttft_slo=1.0, prefill=1, decode=1)
    s.registry.heartbeat(Heartbeat(instance_id="p1", passes=PassSplit(
        chunk_tokens=2048, cut_tokens=100, ratio=1.0, cut_ratio=1.0, wait_s=0.05, shared=True)))
    plan = await s.plan(request("alone", 800), keys(800))  # one full pass: 10 + 800 ms
    assert plan is not None and plan.prefill_estimate.ttft_s == pytest.approx(0.81)
    s.first_token("alone")  # it decodes now, beside the next prompts
    with pytest.raises(SLORejected, match="TTFT"):  # 8 x (10 + 100 + 50 ms) = 1.28 s
        await s.plan(request("long", 800), keys(800))
    plan = await s.plan(request("short", 100), keys(100))
    assert plan is not None and plan.prefill_estimate.ttft_s == pytest.approx(0.16)
    # Queued behind it, that estimate counts as it is: the conductor's own calibration of
    # model-only estimates (here: passes twice as slow) is not applied on top.
    s.tracker.calibration = lambda instance_id: 2.0  # type: ignore[method-assign]
    plan = await s.plan(request("next", 100), keys(100))
    assert plan is not None and plan.prefill_estimate.queue_s == pytest.approx(0.16)
    for rid in ("alone", "short", "next"):
        s.release(rid)
    plan = await s.plan(request("long", 800), keys(800))
    assert plan is not None and plan.prefill_estimate.ttft_s == pytest.approx(0.81)


async def test_a_cut_pass_waits_for_the_decode_step_as_that_decode_measures_it() -> None:
    """Each cut pass waits at least for the largest decode batch's step: its modelled time,
    scaled by what the decode instance reports of its own steps."""
    s = scheduler("cache-global", ttft_slo=10.0, prefill=1, decode=1)
    s.registry.heartbeat(Heartbeat(instance_id="p1", passes=PassSplit(
        chunk_tokens=2048, cut_tokens=100, ratio=1.0, cut_ratio=1.0, wait_s=0.05, shared=True)))
    s.registry.heartbeat(Heartbeat(instance_id="d1", running=10))  # a step of 20 + 50 ms
    plan = await s.plan(request("modelled", 800), keys(800))
    assert plan is not None and plan.prefill_estimate.ttft_s == pytest.approx(8 * 0.18)
    s.release("modelled")
    s.registry.heartbeat(Heartbeat(instance_id="d1", running=10, step_ratio=0.5, wait_s=0.0))
    plan = await s.plan(request("measured", 800), keys(800))  # 35 ms: the passes' own 50 ms
    assert plan is not None and plan.prefill_estimate.ttft_s == pytest.approx(8 * 0.16)
    s.release("measured")
    # The slow tail of its steps (TBT) runs 2x the model, their mean 0.5x: a prompt's passes
    # wait for many steps, so the mean (35 ms) is what they are charged.
    s.registry.heartbeat(Heartbeat(instance_id="d1", running=10, step_ratio=2.0, wait_s=0.0,
                                   step_ratio_mean=0.5))
    plan = await s.plan(request("mean", 800), keys(800))
    assert plan is not None and plan.prefill_estimate.ttft_s == pytest.approx(8 * 0.16)
    assert plan.tbt_s > 2 * 0.07  # the request's own gaps: judged by the tail


async def test_a_prompt_in_untimed_cut_passes_is_held_to_its_own_passes() -> None:
    """Before a prefill has timed passes beside a decode, its cut passes' speed is a prior, and
    so is the queue of the burst's cut passes ahead: a prompt whose own passes fit the SLO is
    let in with a start deadline (its prefill refuses it with 429 if it cannot start by then)
    instead of being refused on that queue. Behind an earlier burst's jobs, or once the speed
    is timed, the queue counts again."""
    s = scheduler("cache-global", ttft_slo=1.0, prefill=1, decode=1)

    def passes(timed: bool) -> None:
        s.registry.heartbeat(Heartbeat(instance_id="p1", passes=PassSplit(
            chunk_tokens=2048, cut_tokens=100, ratio=1.0, cut_ratio=1.0, wait_s=0.05,
            shared=True, cut_timed=timed)))

    async def burst(*tokens: int) -> list[Plan | BaseException]:
        return await asyncio.gather(*(s.plan(request(f"r{n}", n), keys(n)) for n in tokens),
                                    return_exceptions=True)

    passes(timed=False)
    assert await s.plan(request("alone", 800), keys(800)) is not None  # one full pass
    s.first_token("alone")  # it decodes now, beside the next prompts
    before = time.monotonic()
    first, behind, long = await burst(400, 416, 800)  # each 4-8 x (10 + 100 + 50 ms)
    after = time.monotonic()
    assert isinstance(first, Plan) and first.prefill_estimate.ttft_s == pytest.approx(0.64)
    assert isinstance(behind, Plan) and behind.prefill_estimate.ttft_s > 1.0
    own = behind.prefill_estimate.compute_s
    assert own == pytest.approx(0.72, abs=0.01)  # 5 passes: it must start within 0.28 s
    assert behind.start_by is not None
    assert before + 1.0 - own <= behind.start_by <= after + 1.0 - own
    assert isinstance(long, SLORejected)  # its own passes alone: 1.28 s
    with pytest.raises(SLORejected, match="TTFT"):  # behind the last burst's jobs
        await s.plan(request("later", 400), keys(400))
    s.release("r400")
    s.release("r416")
    passes(timed=True)
    first, behind = await burst(400, 416)
    assert isinstance(first, Plan) and isinstance(behind, SLORejected)
