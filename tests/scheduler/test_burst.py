"""Admission per burst: requests that arrive together are decided together, cheapest first,
and no request is refused by a cluster that could serve it alone."""

from __future__ import annotations

import asyncio
import random

import pytest
from sched_helpers import BT, MODEL, Clock, cluster, request

from mooncake_server.roles.conductor.scheduler.bursts import first_pass_share
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.roles.conductor.scheduler.metrics import SchedulerCollector
from mooncake_server.roles.conductor.scheduler.oracle import STORE_WIDE
from mooncake_server.roles.conductor.scheduler.outcomes import RequestOutcomes
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler, Plan, SLORejected


class Hits:
    """A prefix oracle answering per request from a table keyed by the request's first key."""

    def __init__(self, table: dict[str, int]) -> None:
        self.table = table

    async def longest_prefix(self, keys: list[str]) -> dict[str, int]:
        return {STORE_WIDE: self.table.get(keys[0], 0)} if keys else {}


def scheduler(clock: Clock, *, ttft_slo: float | None = 1.0, tbt_slo: float | None = None,
              hits: dict[str, int] | None = None) -> KVCacheScheduler:
    # The scripted cost model: 1 ms per prompt token + 10 ms per pass, 20 + 5 ms per step.
    return KVCacheScheduler(cluster(1, 1, clock=clock), MODEL, block_tokens=BT,
                            oracle=Hits(hits or {}), ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
                            tracker=LoadTracker(clock), rng=random.Random(0),
                            burst_window_s=0.0)


def keys(rid: str, n_tokens: int) -> list[str]:
    return [f"{rid}-k{i}" for i in range(n_tokens // BT)]


async def burst(s: KVCacheScheduler, prompts: dict[str, int],
                ) -> dict[str, Plan | BaseException | None]:
    """Send the prompts at once; each one's plan or rejection."""
    outcomes = await asyncio.gather(*(s.plan(request(rid, n), keys(rid, n))
                                      for rid, n in prompts.items()), return_exceptions=True)
    return dict(zip(prompts, outcomes))


async def test_a_burst_is_decided_at_once_cheapest_first() -> None:
    """Judged in arrival order, the 800-token prompt would go first and only two of five would
    meet a 1 s TTFT; decided together, the three cheapest do, in the order the prefill serves."""
    s = scheduler(Clock())
    got = await burst(s, {"a800": 800, "b100": 100, "c300": 300, "d500": 500, "e200": 200})
    accepted = {rid: p for rid, p in got.items() if isinstance(p, Plan)}
    assert set(accepted) == {"b100", "e200", "c300"}
    assert all(isinstance(got[rid], SLORejected) for rid in ("a800", "d500"))
    assert "estimated TTFT" in str(got["d500"])
    orders = {rid: p.order for rid, p in accepted.items()}
    assert [orders[r].rank for r in ("b100", "e200", "c300")] == [0, 1, 2]
    assert len({o.burst_at for o in orders.values() if o}) == 1 and s.gate.bursts == 1
    # Each estimate counts the cheaper ones placed before it: 110, 110 + 210, + 310 ms.
    ttfts = [accepted[r].prefill_estimate.ttft_s for r in ("b100", "e200", "c300")]
    assert ttfts == pytest.approx([0.11, 0.32, 0.63])
    # The deadline to start: the SLO less its own compute, from placement.
    c300 = accepted["c300"]
    assert c300.start_by is not None


async def test_the_cost_is_the_uncached_work() -> None:
    """A long prompt whose prefix the store holds is cheap: it goes before a short uncached one."""
    s = scheduler(Clock(), hits={"long-k0": 40})  # 640 of its 656 tokens cached
    got = await burst(s, {"short": 200, "long": 656})
    assert isinstance(got["short"], Plan) and isinstance(got["long"], Plan)
    assert got["long"].order.rank == 0 and got["short"].order.rank == 1  # type: ignore[union-attr]


async def test_a_later_burst_queues_behind_the_earlier_one() -> None:
    """Earliest deadline across bursts: the second burst's estimates count the first's work."""
    s = scheduler(Clock())
    first = await burst(s, {"x": 400})
    second = await burst(s, {"y": 100})
    x, y = first["x"], second["y"]
    assert isinstance(x, Plan) and isinstance(y, Plan)
    assert y.prefill_estimate.queue_s == pytest.approx(0.41)
    assert x.order.burst_at <= y.order.burst_at and s.gate.bursts == 2  # type: ignore[union-attr]


async def test_no_slo_flags_no_gathering() -> None:
    """Without SLOs nothing is refused, so nothing waits for a burst to gather."""
    s = scheduler(Clock(), ttft_slo=None)
    got = await burst(s, {"a": 800, "b": 100})
    assert all(isinstance(p, Plan) and p.order is None and p.start_by is None
               for p in got.values())
    assert s.gate.bursts == 0


async def test_an_idle_cluster_accepts_whatever_fits_alone() -> None:
    """Fresh start, no measurement: every request that meets the SLOs alone is accepted."""
    s = scheduler(Clock(), ttft_slo=5.0, tbt_slo=0.2)
    for i, n in enumerate((2, 100, 2000, 4000)):
        got = await burst(s, {f"r{i}": n})
        assert isinstance(got[f"r{i}"], Plan)
        s.release(f"r{i}")


async def test_no_429_on_an_idle_cluster_before_the_next_heartbeat() -> None:
    """The decode's last beat was sent while a request decoded; that request has finished since.
    The next lone prompt on the idle cluster is estimated in full passes (10 + 900 ms), not in
    cut passes beside a busy decode (9 x (10 + 100 + 50) ms = 1.44 s, refused)."""
    from mooncake_server.wire.instances import Heartbeat

    s = scheduler(Clock(), ttft_slo=1.0, tbt_slo=0.2)
    shared_prefill(s)
    first = await burst(s, {"first": 100})
    assert isinstance(first["first"], Plan)
    s.registry.heartbeat(Heartbeat(instance_id="d1", running=1))  # sent while it decoded
    s.first_token("first")
    s.release("first")
    got = await burst(s, {"next": 900})
    assert isinstance(got["next"], Plan)
    assert got["next"].prefill_estimate.compute_s == pytest.approx(0.91)


async def test_no_429_after_a_burst_of_rejections() -> None:
    """Rejected requests leave nothing in the ledger: once the accepted work is done, the idle
    cluster accepts again at once."""
    clock = Clock()
    s = scheduler(clock, ttft_slo=1.0, tbt_slo=0.2)
    got = await burst(s, {f"r{i}": 600 for i in range(10)})
    accepted = [rid for rid, p in got.items() if isinstance(p, Plan)]
    assert len(accepted) == 1 and s.rejected == 9
    for rid in accepted:
        s.first_token(rid)
        s.release(rid)
    clock.now += 0.01
    again = await burst(s, {"after": 600})
    assert isinstance(again["after"], Plan)


async def test_no_429_after_an_overload_once_it_drained() -> None:
    """An overload's measurements (prefills three times their estimate) make later estimates
    slower, but they age out: 10 s after the last one, an idle cluster accepts again."""
    clock = Clock()
    s = scheduler(clock, ttft_slo=1.0, tbt_slo=0.2)
    s.tracker = LoadTracker(clock, horizon_s=10.0)
    for i in range(8):  # each 300-token prefill took 0.93 s, three times its estimate
        s.tracker.assign(f"o{i}", "p1", 0.31, "d1", 300)
        clock.now += 0.93
        s.first_token(f"o{i}")
        s.release(f"o{i}")
    clock.now += 1.0
    with pytest.raises(SLORejected):
        await s.plan(request("during", 400), keys("during", 400))
    clock.now += 10.0
    got = await burst(s, {"after": 400})
    assert isinstance(got["after"], Plan)


async def test_a_bursts_own_jobs_do_not_count_as_cutting_its_passes() -> None:
    """On a prefill instance sharing its cores with a decode, prompts queued behind earlier work
    are computed in cut passes (each waiting for a decode step); the jobs of the same burst are
    batched into full passes with it, so they do not make it cut."""
    from mooncake_server.wire.instances import Heartbeat, PassSplit

    s = scheduler(Clock(), ttft_slo=5.0)
    s.registry.heartbeat(Heartbeat(instance_id="p1", passes=PassSplit(
        chunk_tokens=2048, cut_tokens=100, ratio=1.0, cut_ratio=1.0, wait_s=0.05, shared=True)))
    got = await burst(s, {"one": 1, "mid": 500})
    mid = got["mid"]
    assert isinstance(mid, Plan)
    # Full speed, in one pass with the 1-token job (whose 10 ms per pass it does not pay
    # again): 11 + 500 ms; cut, it would be 5 x (10 + 100 + 50 ms) = 0.8 s of its own.
    assert mid.prefill_estimate.ttft_s == pytest.approx(0.011 + 0.5)
    later = await burst(s, {"later": 500})  # behind the first burst's work: cut passes
    assert isinstance(later["later"], Plan)
    assert later["later"].prefill_estimate.compute_s == pytest.approx(5 * 0.16)


def shared_prefill(s: KVCacheScheduler, chunk_tokens: int = 2048,
                   measured_tokens: int | None = None) -> None:
    """p1 shares its cores with a decode: 100-token cut passes waiting 50 ms each beside it;
    its speed measured on full passes of `measured_tokens` (default: a chunk)."""
    from mooncake_server.wire.instances import Heartbeat, PassSplit

    s.registry.heartbeat(Heartbeat(instance_id="p1", passes=PassSplit(
        chunk_tokens=chunk_tokens, cut_tokens=100, ratio=1.0, cut_ratio=1.0, wait_s=0.05,
        shared=True, measured_tokens=chunk_tokens if measured_tokens is None
        else measured_tokens)))


async def test_a_prompt_beyond_the_bursts_first_pass_is_estimated_in_cut_passes() -> None:
    """The instance batches the burst's prompts into one first pass while they fit two of its
    chunks (with a TTFT SLO); the next one runs after it, beside that pass's requests decoding,
    in cut passes that each wait for their step. Estimated at full speed it was accepted and
    missed its TTFT by 2x; estimated as it runs, it is refused at once."""
    s = scheduler(Clock(), ttft_slo=1.0)
    shared_prefill(s, chunk_tokens=300)
    got = await burst(s, {"a": 200, "b": 300, "c": 400})
    a, b = got["a"], got["b"]
    assert isinstance(a, Plan) and isinstance(b, Plan)
    assert a.first_pass and b.first_pass
    # c: after the 0.52 s pass (two forwards: b's tokens cross into a second, 10 ms each), 4
    # cut passes of 10 + 100 ms, each after a wait for the step of the 2 sequences decoding
    # (30 ms; the 50 ms measured is longer): 1.16 s > 1 s.
    assert isinstance(got["c"], SLORejected) and "estimated TTFT 1.16 s" in str(got["c"])
    # Both answer when their shared pass ends; they wait for each other at the instance.
    assert a.prefill_estimate.ttft_s == b.prefill_estimate.ttft_s == pytest.approx(0.52)
    assert (a.order.rank, a.order.pass_ranks) == (0, 2)  # type: ignore[union-attr]
    assert (b.order.rank, b.order.pass_ranks) == (1, 2)  # type: ignore[union-attr]
    # The pass starts once, for both: by the SLO less the whole pass, from placement.
    assert a.start_by == pytest.approx(b.start_by) and b.start_by is not None


async def test_with_a_ttft_slo_a_bursts_first_pass_runs_past_one_chunk() -> None:
    """Cut off at one chunk, the 400-token prompt would run beside the decoding of the other
    two and miss 1.1 s; in the same first pass (two forwards back to back, answered together)
    all three answer at 0.92 s. Past one chunk the pass must end within 0.85 of the SLO until
    the scheduler has seen how its long estimates run: its jobs all miss together if it runs
    long."""
    s = scheduler(Clock(), ttft_slo=1.2)
    shared_prefill(s, chunk_tokens=600)
    got = await burst(s, {"a": 200, "b": 300, "c": 400})
    plans = [got[r] for r in ("a", "b", "c")]
    assert all(isinstance(p, Plan) and p.first_pass for p in plans)
    # 10 + 200 + 300 ms in the first forward, 10 + 400 ms for c's (it crosses into a second).
    assert [p.prefill_estimate.ttft_s for p in plans] == pytest.approx([0.92] * 3)
    assert [(p.order.rank, p.order.pass_ranks) for p in plans] == [(0, 3), (1, 3), (2, 3)]
    # With a 0.9 s SLO, 0.92 s is past 0.85 of it, and past the SLO a pass's tail may reach:
    # c runs after the pass, in cut passes (late).
    s = scheduler(Clock(), ttft_slo=0.9)
    shared_prefill(s, chunk_tokens=600)
    got = await burst(s, {"a": 200, "b": 300, "c": 400})
    assert isinstance(got["c"], SLORejected) and "estimated TTFT 1.15 s" in str(got["c"])
    # So it does when the instance timed no full pass of at least 3/4 of a chunk lately: its
    # speed on short passes does not predict a long one. c then runs whole after the pass all
    # the same (the instance holds a and b's hand-off to the decode while c is queued, as it
    # ends by 0.95 s, 0.25 s before their first token's deadline): 0.92 s.
    s = scheduler(Clock(), ttft_slo=1.2)
    shared_prefill(s, chunk_tokens=600, measured_tokens=449)
    c = (await burst(s, {"a": 200, "b": 300, "c": 400}))["c"]
    assert isinstance(c, Plan) and not c.first_pass
    assert c.prefill_estimate.ttft_s == pytest.approx(0.92, abs=0.005)
    # Without a TTFT SLO nothing bounds the pass's time: it stops at one chunk.
    s = scheduler(Clock(), ttft_slo=None, tbt_slo=1.0)
    shared_prefill(s, chunk_tokens=600)
    got = await burst(s, {"a": 200, "b": 300, "c": 400})
    assert [p.first_pass for p in got.values()] == [True, True, False]  # type: ignore[union-attr]


def ran_over(s: KVCacheScheduler, clock: Clock, ratio: float) -> None:
    """A request estimated at the whole TTFT SLO measured `ratio` times that, just now."""
    assert s.ttft_slo_s is not None
    s.outcomes = RequestOutcomes(s.ttft_slo_s, s.tbt_slo_s, clock=clock)
    s.outcomes.placed("earlier", ttft_estimate_s=s.ttft_slo_s, tbt_estimate_s=0.1)
    clock.now += ratio * s.ttft_slo_s
    s.outcomes.first_token("earlier")
    s.outcomes.finished("earlier")


def test_the_first_pass_share_leaves_room_for_the_worst_recent_overrun_and_a_drift() -> None:
    """The pass must end within the SLO if it runs 10% further over its estimate than the worst
    recent long estimate did; 0.85 of the SLO until one was measured; 0.8 to 0.95."""
    assert first_pass_share(None) == pytest.approx(0.85, abs=0.001)
    assert first_pass_share(0.9) == 0.95
    assert first_pass_share(1.05) == pytest.approx(1 / (1.05 * 1.1))
    assert first_pass_share(1.3) == 0.8


@pytest.mark.parametrize(("overrun", "joins"), [(0.9, True), (1.25, False)])
async def test_the_first_pass_takes_the_share_of_the_slo_recent_estimates_earned(
        overrun: float, joins: bool) -> None:
    """A lone 700-token prompt, past one 600-token chunk, ends its pass at 0.72 s (two
    forwards), 0.9 of a 0.8 s SLO. Lately a long estimate ran 0.9x: the pass may take 0.95 of
    the SLO (the most), and it is let in. One that ran 1.25x leaves it 0.8, and it is refused:
    alone, it has no forward before it to time, so it cannot be a tail."""
    clock = Clock()
    s = scheduler(clock, ttft_slo=0.8)
    ran_over(s, clock, overrun)
    shared_prefill(s, chunk_tokens=600)
    got = (await burst(s, {"a": 700}))["a"]
    if joins:
        assert isinstance(got, Plan) and got.first_pass and not got.prefill_estimate.pass_tail
        assert got.prefill_estimate.ttft_s == pytest.approx(0.72)
    else:
        assert isinstance(got, SLORejected)
    # /metrics says which share admission works with now.
    share = next(m for m in SchedulerCollector(s).collect()
                 if m.name == "mooncake_scheduler_first_pass_slo_share")
    assert share.samples[0].value == pytest.approx(0.95 if joins else 0.8)


async def test_the_prompt_that_takes_the_first_pass_past_one_chunk_is_its_tail() -> None:
    """a fills most of a 600-token chunk; b would take the pass past it, so b joins as the
    pass's tail, whatever share of the SLO the pass would take: in a forward of its own (10 ms
    more than sharing a's second forward), the whole pass at 0.72 s, and its job tells the
    prefill to start it only if a's forward ran in time. Sharing a's forwards, a pass that ran
    long answered a's job early and b's rest was cut beside its decoding: a 1,518-token prompt
    answered at 6.47-7.53 s against a 5 s SLO (goodput replays). The pass takes nothing after
    its tail: c runs after it. With a 0.7 s SLO the tail would end past it: refused."""
    s = scheduler(Clock(), ttft_slo=5.0)
    shared_prefill(s, chunk_tokens=600)
    got = await burst(s, {"a": 300, "b": 400, "c": 450})
    a, b, c = (got[r] for r in ("a", "b", "c"))
    assert isinstance(a, Plan) and isinstance(b, Plan) and isinstance(c, Plan)
    assert [p.first_pass for p in (a, b, c)] == [True, True, False]
    assert [p.prefill_estimate.pass_tail for p in (a, b)] == [False, True]
    # Every member answers when the pass ends: after the tail's forward.
    assert [p.prefill_estimate.ttft_s for p in (a, b)] == pytest.approx([0.72] * 2)
    assert [(p.order.rank, p.order.pass_ranks) for p in (a, b)] == [(0, 2), (1, 2)]
    s = scheduler(Clock(), ttft_slo=0.7)
    shared_prefill(s, chunk_tokens=600)
    got = await burst(s, {"a": 300, "b": 400})
    assert isinstance(got["a"], Plan) and isinstance(got["b"], SLORejected)
    # Alone, a prompt past the share is no tail: no forward before it tells its speed.
    s = scheduler(Clock(), ttft_slo=0.9)
    shared_prefill(s, chunk_tokens=600)
    assert isinstance((await burst(s, {"a": 810}))["a"], SLORejected)


async def test_ranks_are_counted_per_prefill_instance() -> None:
    """An instance waits for the ranks before its head: ranks sent to another instance would
    never come, so each instance's jobs are ranked 0.. among themselves."""
    s = KVCacheScheduler(cluster(2, 1, clock=Clock()), MODEL, block_tokens=BT,
                         policy="load", ttft_slo_s=5.0, tracker=LoadTracker(Clock()),
                         rng=random.Random(0), burst_window_s=0.0)
    got = await burst(s, {"a": 100, "b": 200, "c": 300, "d": 400})
    plans = [p for p in got.values() if isinstance(p, Plan)]
    assert len(plans) == 4
    for iid in ("p1", "p2"):
        ranks = sorted(p.order.rank for p in plans  # type: ignore[union-attr]
                       if p.prefill.instance_id == iid)
        assert ranks == list(range(len(ranks))) and ranks


async def test_a_decode_beside_a_prefill_is_judged_with_the_pass_it_will_wait_for() -> None:
    """Prompts that come while a request decodes run beside its steps, in passes sized to what
    the step leaves of 0.75 of the TBT SLO (at least 0.2 of it): its TBT estimate counts them."""
    s = scheduler(Clock(), ttft_slo=5.0, tbt_slo=0.2)
    alone = await burst(s, {"alone": 50})
    shared_prefill(s)
    beside = await burst(s, {"beside": 50})
    a, b = alone["alone"], beside["beside"]
    assert isinstance(a, Plan) and isinstance(b, Plan)
    assert a.tbt_s == pytest.approx(0.025)  # its own step: no prefill on its cores
    assert b.tbt_s == pytest.approx(0.15)  # 2 sequences' 30 ms step + the 120 ms pass it leaves


@pytest.mark.parametrize(("max_tokens", "b_ttft"), [(3, 1.6 + 0.299), (64, 1.6 + 1.65),
                                                     (None, 1.6 + 1.65)])
async def test_a_prompt_that_starts_after_the_last_bursts_decoding_waits_for_its_own(
        max_tokens: int | None, b_ttft: float) -> None:
    """Twenty requests of an earlier burst decode in 120 ms steps, so a's passes beside them are
    cut to 30 tokens each waiting 120 ms: 1.6 s. When they have two tokens left each (0.32 s
    of steps and passes), b, which starts after a, waits for no step: the instance holds a's
    hand-off to the decode while b is queued (prefill/hand_on.py), so b runs whole: 0.299 s.
    Charged the old steps, a burst that came as the last one's requests ended was refused (a
    422-token prompt at an estimated 6.01 s, which colocated served in 3.24 s). With 63 tokens
    left, or lengths unknown, b waits for the old steps, a's among them (125 ms): 1.65 s."""
    s = scheduler(Clock(), ttft_slo=5.0, tbt_slo=0.2)
    shared_prefill(s)
    for i in range(20):
        s.tracker.assign(f"old{i}", "p1", 0.0, "d1", 1000, max_tokens=max_tokens)
        s.tracker.prefill_done(f"old{i}")
    got = await burst(s, {"a": 299, "b": 300})
    a, b = got["a"], got["b"]
    assert isinstance(a, Plan) and isinstance(b, Plan)
    assert a.prefill_estimate.ttft_s == pytest.approx(1.6, abs=0.002)
    assert b.prefill_estimate.ttft_s == pytest.approx(b_ttft, abs=0.002)


async def test_small_prompts_after_the_first_pass_share_the_pass_they_are_batched_in() -> None:
    """Beside a busy decode the instance takes a job and those after it that fit in one chunk
    beside it, and computes them in one pass: the jobs that join pay their tokens, not another
    pass's 10 ms and 50 ms wait. Charged a pass each, eight prompts of 1-6 tokens were
    estimated at 0.12-1.00 s and answered at 0.07-0.34 s, and the 444-token prompt behind
    them was refused at an estimated 5.38 s. And all of a pass's jobs answer when it ends:
    estimated one after the other, a burst's 1-token prompts read 14x their estimates."""
    s = scheduler(Clock(), ttft_slo=5.0)
    shared_prefill(s)
    for i in range(2):  # an earlier burst decodes: every pass is cut to 100 tokens
        s.tracker.assign(f"old{i}", "p1", 0.0, "d1", 100)
        s.tracker.prefill_done(f"old{i}")
    got = await burst(s, {"a": 1, "b": 2, "c": 3, "d": 50, "e": 100})
    ttfts = [got[r].prefill_estimate.ttft_s for r in "abcde"]  # type: ignore[union-attr]
    # a: 10 + 1 ms after a 50 ms wait; b, c, d join its pass (56 tokens), which ends at
    # 0.116 s for all four; e opens the next.
    assert ttfts == pytest.approx([0.116] * 4 + [0.116 + 0.11 + 0.05])
    batched = [got[r].batched for r in "abcde"]  # type: ignore[union-attr]
    assert batched == [False, True, True, True, False]


async def test_the_wait_for_a_burst_to_gather_counts_in_its_ttft() -> None:
    """The client's clock starts when the request comes, not when its burst is decided: the
    gathering is part of each estimate, of the SLO check and of the deadlines."""
    clock = Clock()
    s = KVCacheScheduler(cluster(1, 1, clock=clock), MODEL, block_tokens=BT, oracle=Hits({}),
                         ttft_slo_s=1.0, tracker=LoadTracker(clock), rng=random.Random(0),
                         burst_window_s=0.01)
    # 100 tokens: 0.11 s alone; 870 tokens: 0.88 s alone, within the SLO by 0.12 s.
    tasks = {rid: asyncio.ensure_future(s.plan(request(rid, n), keys(rid, n)))
             for rid, n in (("short", 100), ("long", 870))}
    await asyncio.sleep(0)  # both came, and wait for their burst
    clock.now += 0.04  # the ledger's clock: the burst gathered for 40 ms
    got = dict(zip(tasks, await asyncio.gather(*tasks.values(), return_exceptions=True)))
    short = got["short"]
    assert isinstance(short, Plan)
    assert short.prefill_estimate.ttft_s == pytest.approx(0.04 + 0.11)
    assert short.prefill_estimate.waited_s == pytest.approx(0.04)
    # Its first token is due 1 s after it came, and it must start 0.11 s before that.
    assert short.answer_by is not None and short.start_by is not None
    assert short.answer_by - short.start_by == pytest.approx(0.11)
    # Queued behind the short one it ends at 0.04 + 0.11 + 0.88 s: past the SLO.
    assert isinstance(got["long"], SLORejected) and "1.03 s" in str(got["long"])
