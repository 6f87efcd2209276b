"""The prefill instance's queue: served in the admission's order, late jobs turned away."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from mooncake_server.roles.prefill.job_queue import (
    ORDER_WAIT_S,
    JobQueue,
    LateForSLO,
    first_pass_late,
    forward_shares,
    joins_forward,
    tail_late,
)
from mooncake_server.roles.prefill.metrics import PrefillMetrics
from mooncake_server.roles.prefill.task import PrefillTask
from mooncake_server.roles.prefill.worker import PrefillWorker
from mooncake_server.wire.jobs import PrefillJob, SamplingParams


@dataclass
class Task:
    job: PrefillJob
    queued_at: float
    queued_wall: float
    cancelled: bool = False

    def gone(self) -> bool:
        return self.cancelled


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def task(rid: str, tokens: int, *, at: float = 0.0, burst_at: float | None = None,
         rank: int = 0, within: float | None = None, wall: float = 1000.0) -> Task:
    job = PrefillJob(request_id=rid, prompt_token_ids=[1] * tokens, block_keys=[],
                     sampling=SamplingParams(max_tokens=4), burst_at=burst_at, burst_rank=rank,
                     start_within_s=within)
    return Task(job, 50.0 + at, wall)


def ids(tasks: list) -> list[str]:  # type: ignore[type-arg]
    return [t.job.request_id for t in tasks]


def test_a_burst_is_served_by_rank_and_earlier_bursts_first() -> None:
    """The jobs of one burst reach the instance in any order (each after its own decode
    reservation); they run by rank, and a later burst waits for the earlier one."""
    q = JobQueue(Clock())
    for t in (task("later", 10, burst_at=2000.0), task("b-rank2", 300, burst_at=1000.0, rank=2),
              task("b-rank0", 100, burst_at=1000.0, rank=0),
              task("b-rank1", 200, burst_at=1000.0, rank=1)):
        q.push(t)
    assert ids(q.take(budget_tokens=300)[0]) == ["b-rank0", "b-rank1"]  # 300 tokens: one chunk
    assert ids(q.take(budget_tokens=300)[0]) == ["b-rank2"]
    assert ids(q.take(budget_tokens=300)[0]) == ["later"]
    assert len(q) == 0


def test_a_job_past_its_start_deadline_is_set_aside_before_any_work() -> None:
    """Reconsidered when its turn comes: a job that waited longer than its TTFT SLO allowed is
    handed back as late (the worker answers 429), the next one runs."""
    clock = Clock()
    q = JobQueue(clock)
    q.push(task("late", 100, burst_at=1.0, within=0.5))
    q.push(task("on-time", 100, burst_at=2.0, within=5.0))
    q.push(task("no-deadline", 100, burst_at=3.0))
    clock.now += 0.6
    batch, late = q.take(budget_tokens=1000)
    assert ids(late) == ["late"] and ids(batch) == ["on-time", "no-deadline"]


def test_a_late_job_the_instance_still_finds_in_time_runs_alone() -> None:
    """The start deadline came from the conductor's estimate at placing; when the job's turn
    comes the instance may know better (`in_time`, its own measured speed). A late job it finds
    in time runs, alone, as it was judged; one it does not is set aside. A late job behind the
    batch's head is not asked: its time would start after the head's."""
    clock = Clock()
    q = JobQueue(clock)
    for t in (task("late-ok", 100, burst_at=1.0, within=0.5),
              task("late-no", 100, burst_at=1.0, rank=1, within=0.5),
              task("next", 100, burst_at=2.0, within=5.0)):
        q.push(t)
    clock.now += 0.6
    asked: list[str] = []

    def in_time(t: Task) -> bool:  # type: ignore[type-arg]
        asked.append(t.job.request_id)
        return t.job.request_id == "late-ok"

    batch, late = q.take(budget_tokens=1000, in_time=in_time)
    assert ids(batch) == ["late-ok"] and not late  # "next" would have fit: not beside it
    batch, late = q.take(budget_tokens=1000, in_time=in_time)
    assert ids(late) == ["late-no"] and ids(batch) == ["next"]
    assert asked == ["late-ok", "late-no"]
    q.push(task("head", 100, burst_at=3.0, within=5.0))
    q.push(task("behind", 100, burst_at=3.0, rank=1, within=0.5))
    clock.now += 0.6
    batch, late = q.take(budget_tokens=1000, in_time=in_time)
    assert ids(batch) == ["head"] and ids(late) == ["behind"]
    assert asked == ["late-ok", "late-no"]


def test_jobs_without_an_order_run_in_arrival_order_and_cancelled_ones_are_dropped() -> None:
    q = JobQueue(Clock())
    first, gone, second = task("first", 10, wall=1.0), task("gone", 10, wall=2.0), \
        task("second", 10, wall=3.0)
    gone.cancelled = True
    for t in (second, gone, first):
        q.push(t)
    batch, late = q.take(budget_tokens=1000)
    assert ids(batch) == ["first", "second"] and late == []


def test_a_rank_waits_for_the_ranks_before_it_to_arrive() -> None:
    """Rank 1 reaches the instance first (its decode reservation came back sooner): it waits
    for rank 0 rather than start a pass the cheaper job would then wait behind; a rank that
    never comes (its request went away) holds it no longer than ORDER_WAIT_S."""
    clock = Clock()
    q = JobQueue(clock)
    q.push(task("long-rank1", 900, burst_at=1.0, rank=1))
    assert q.take(budget_tokens=100) == ([], []) and q.hold_s == ORDER_WAIT_S
    q.push(task("short-rank0", 50, burst_at=1.0, rank=0))
    assert ids(q.take(budget_tokens=100)[0]) == ["short-rank0"]
    assert ids(q.take(budget_tokens=100)[0]) == ["long-rank1"]
    q.push(task("orphan-rank3", 10, burst_at=2.0, rank=3))
    assert q.take(budget_tokens=100)[0] == [] and q.hold_s > 0
    clock.now += ORDER_WAIT_S + 0.01
    assert ids(q.take(budget_tokens=100)[0]) == ["orphan-rank3"]


def test_the_ranks_of_a_first_pass_wait_for_one_another() -> None:
    """The conductor predicted ranks 0-2 in one pass: started with the first arrivals, the rest
    would run in later passes beside their decode, seconds later."""
    clock = Clock()
    q = JobQueue(clock)

    def member(rid: str, rank: int) -> Task:
        t = task(rid, 100, burst_at=1000.0, rank=rank)
        t.job = t.job.model_copy(update={"burst_pass": 3})
        return t

    q.push(member("r0", 0))
    q.push(member("r1", 1))
    assert q.take(budget_tokens=2048)[0] == [] and q.hold_s == ORDER_WAIT_S
    q.push(member("r2", 2))
    assert ids(q.take(budget_tokens=2048)[0]) == ["r0", "r1", "r2"]


def test_a_first_pass_is_taken_whole_past_the_chunk() -> None:
    """The conductor sized the burst's first pass by its TTFT SLO, past one chunk: the instance
    takes it whole (the worker runs it chunk by chunk and answers it together); the ranks after
    it, and a batch of no first pass, stop at the chunk as before."""
    q = JobQueue(Clock())
    for rank, n in enumerate((300, 900, 1200, 100)):
        t = task(f"r{rank}", n, burst_at=1000.0, rank=rank)
        t.job = t.job.model_copy(update={"burst_pass": 3})
        q.push(t)
    assert ids(q.take(budget_tokens=1024)[0]) == ["r0", "r1", "r2"]  # 2,400 tokens
    assert ids(q.take(budget_tokens=1024)[0]) == ["r3"]
    for rank, n in enumerate((300, 900)):
        q.push(task(f"s{rank}", n, burst_at=2000.0, rank=rank))
    assert ids(q.take(budget_tokens=1024)[0]) == ["s0"]


def test_a_first_pass_is_late_by_how_far_its_rest_ends_past_the_earliest_deadline() -> None:
    assert first_pass_late([105.0, 103.0, None], rest_s=4.0, now=100.0) == pytest.approx(1.0)
    assert first_pass_late([105.0], rest_s=4.0, now=100.0) == 0.0  # in time
    assert first_pass_late([None], rest_s=40.0, now=100.0) == 0.0  # no deadline
    assert first_pass_late([101.0], rest_s=None, now=100.0) == 0.0  # no speed to tell


def test_a_tail_is_started_only_in_a_forward_of_its_own() -> None:
    # 30 + 20 tokens fill a 64-token forward to 50; the tail's 40 wait for the next forward.
    assert forward_shares([(30, False, 0), (20, False, 0), (40, True, 0)], 64, 2) == [30, 20, 0]
    # Alone (the others computed), the tail takes the forward; later ones wait behind it.
    assert forward_shares([(40, True, 0), (10, False, 0)], 64, 2) == [40, 10]
    assert forward_shares([(100, True, 0), (10, False, 0)], 64, 2) == [64, 0]
    # Not a tail, or one already started: packed as before.
    assert forward_shares([(30, False, 0), (50, False, 0)], 64, 2) == [30, 34]


def test_a_prompt_cut_short_is_cut_on_a_kv_block_boundary() -> None:
    """A prompt the forward cannot finish stops at the end of a block, so every block's KV is
    computed in one forward and has the same bits however the passes fell (a shared prefix's
    blocks are stored once, under their tokens' key)."""
    # 30 tokens leave 34: the second prompt computes two 16-token blocks, not 34 tokens.
    assert forward_shares([(30, False, 0), (50, False, 0)], 64, 16) == [30, 32]
    # Resuming at 32 with 40 tokens of room: up to 64, the next boundary within reach.
    assert forward_shares([(60, False, 32)], 40, 16) == [32]
    # A prompt's end needs no boundary; a forward with no room for one block of the next
    # prompt leaves it for the next forward.
    assert forward_shares([(7, False, 48), (40, False, 0)], 20, 16) == [7, 0]
    # Alone in a forward smaller than a block, a prompt still computes one whole block.
    assert forward_shares([(40, False, 16)], 10, 16) == [16]


def test_a_tail_is_late_if_it_would_end_past_a_deadline_running_a_tenth_slower() -> None:
    assert tail_late([105.0, None], rest_s=4.5, now=100.0) == 0.0  # 4.95 s: in time
    assert tail_late([105.0], rest_s=4.6, now=100.0) == pytest.approx(0.06)
    assert tail_late([110.0, 104.0], rest_s=3.0, now=100.0) == 0.0
    assert tail_late([103.0], rest_s=None, now=100.0) == 0.0  # no speed to tell: it runs


async def test_the_worker_starts_a_late_job_only_if_its_measured_speed_ends_it_by_its_due() -> None:
    """The prefill worker asks its own timing (`ChunkBudget.prompt_s`) when a job's start
    deadline passed: due in 3 s, a prompt timed at 2.5 s starts (10% slower: 2.75 s); timed at
    2.8 s (3.08 s) or not timed at all it is refused with 429, before any work."""
    class Worker(PrefillWorker):
        def __init__(self, run_s: float | None) -> None:  # none of the engine is needed
            self._queue = JobQueue()
            self.chunks = SimpleNamespace(prompt_s=lambda n, beside, step: run_s)
            self.runner = SimpleNamespace(cores=SimpleNamespace(others_step_s=lambda: 0.03))
            self.cache = SimpleNamespace(release=lambda blocks: None)
            self.registry = CollectorRegistry()
            self.metrics = PrefillMetrics(self.registry)

        def _beside_decode(self) -> bool:
            return True

        def _chunk_tokens(self) -> int:
            return 64

    loop = asyncio.get_running_loop()
    for run_s, starts in ((2.5, True), (2.8, False), (None, False)):
        worker = Worker(run_s)
        job = PrefillJob(request_id="r", prompt_token_ids=[1] * 400, block_keys=[],
                         sampling=SamplingParams(max_tokens=4), start_within_s=0.5,
                         answer_within_s=4.0)
        queued = PrefillTask(job, loop.create_future(), queued_at=time.perf_counter() - 1.0)
        worker._queue.push(queued)
        assert [t.job.request_id for t in worker._take_batch()] == (["r"] if starts else [])
        assert queued.done.done() is not starts
        # /metrics counts the jobs started so.
        assert worker.registry.get_sample_value("mooncake_prefill_late_started_total") == (
            1 if starts else 0)
        if not starts:
            with pytest.raises(LateForSLO, match="could not start within 0.50 s"):
                queued.done.result()


def test_a_job_joins_a_forward_only_while_its_members_are_answered_about_when_estimated() -> None:
    # 2 s left to the earliest estimate: a 2.2 s forward is within 1.15 of it, 2.4 s is not.
    assert joins_forward([102.0, 105.0, None], pass_s=2.2, added_s=1.5, fixed_s=0.07, now=100.0)
    assert not joins_forward([102.0, 105.0], pass_s=2.4, added_s=1.5, fixed_s=0.07, now=100.0)
    # A job adding less than a forward's fixed cost joins: its own forward would cost more.
    assert joins_forward([102.0], pass_s=2.4, added_s=0.05, fixed_s=0.07, now=100.0)
    # No estimate or no speed: packed by tokens alone, as before.
    assert joins_forward([None], pass_s=9.0, added_s=9.0, fixed_s=0.07, now=100.0)
    assert joins_forward([101.0], pass_s=None, added_s=9.0, fixed_s=0.07, now=100.0)


@pytest.mark.parametrize("estimated", ["one after the other", "together"])
async def test_the_worker_packs_a_forward_as_the_conductor_estimated_its_jobs(
        estimated: str) -> None:
    """A replay's burst (x2): prompts of 2-542 tokens the conductor estimated one after the
    other, from 0.18 s to 3.56 s. Packed by tokens they ran in one 1,958-token forward and the
    small ones were answered at 3.01 s (16x their estimates); now the first forward takes the
    three small ones alone. Estimated as one batch (all at its end), they run in one forward."""
    from mooncake_server.cost_model.perf_model import PerfModel
    from mooncake_server.roles.prefill.chunk_budget import ChunkBudget

    model = PerfModel(prefill_a=0.0, prefill_b=1.35e-3, prefill_c=0.073, prefill_e=0.0)

    class Worker(PrefillWorker):
        def __init__(self) -> None:  # none of the engine is needed
            self._queue = JobQueue()
            self.chunks = ChunkBudget(256, model, tbt_slo_s=0.2)
            self.chunks.observe([(1024, 0)], model.prefill_s(1024))  # full passes as modelled
            self.metrics = PrefillMetrics(CollectorRegistry())

        def _chunk_tokens(self) -> int:
            return 2048

    sizes = [2, 6, 9, 453, 457, 489, 542]
    expected = ([0.18, 0.27, 0.36, 1.44, 2.09, 2.79, 3.56] if estimated == "one after the other"
                else [3.7] * len(sizes))
    worker = Worker()
    loop = asyncio.get_running_loop()
    for i, (n, within) in enumerate(zip(sizes, expected)):
        job = PrefillJob(request_id=f"r{n}", prompt_token_ids=[1] * n, block_keys=[],
                         sampling=SamplingParams(max_tokens=4), expect_within_s=within)
        worker._queue.push(PrefillTask(job, loop.create_future(), queued_wall=1000.0 + i))
    taken = [t.job.request_id for t in worker._take_batch()]
    assert taken == (["r2", "r6", "r9"] if estimated == "one after the other"
                     else [f"r{n}" for n in sizes])
