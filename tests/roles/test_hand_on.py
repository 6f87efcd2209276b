"""A prefill holds an answered job's hand-off to the decode beside it while prompts queued behind
it run whole; the client has the first token at once (prefill/hand_on.py).

The loop is the real `PrefillWorker._serve` with its real answers (`_answer`) and pass sizing
(`_pass_shares`); its forward walks the prompts' token counts instead of running a model, and
the store work is skipped, so the test reads what the decode would see: when each job went on
to it, and how long the passes beside it were.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from mooncake_server.cost_model.passes import HOLD_MARGIN_S
from mooncake_server.roles.prefill.hand_on import HOLD_MIN_S, HandOffs, HandOn
from mooncake_server.roles.prefill.job_queue import JobQueue
from mooncake_server.roles.prefill.metrics import PrefillMetrics
from mooncake_server.roles.prefill.task import PrefillTask
from mooncake_server.roles.prefill.worker import PrefillWorker
from mooncake_server.wire.jobs import FirstToken, PrefillJob, PrefillResult, SamplingParams

FULL, CUT = 64, 8  # prompt tokens of a pass alone, and of one beside a decode with work


class Cores:
    """The core board: a decode process beside this prefill (or none), idle."""

    def __init__(self, present: int = 1) -> None:
        self.present = present

    def others_present(self) -> int:
        return self.present

    def others_active(self) -> int:
        return 0

    def others_handed_in(self) -> int:
        return 0

    def others_step_s(self) -> float:
        return 0.03


class Told(asyncio.Future):  # type: ignore[type-arg]
    """A job's future that logs the moment its result is set (it goes on to the decode)."""

    def __init__(self, events: list[tuple[str, ...]], rid: str) -> None:
        super().__init__()
        self.events, self.rid = events, rid

    def set_result(self, result: Any) -> None:
        self.events.append(("on to the decode", self.rid))
        super().set_result(result)


class WalkingWorker(PrefillWorker):
    """The real queue, pass sizing and answers; forwards walk the prompts' token counts."""

    def __init__(self, pass_s_per_token: float, cores: Cores) -> None:  # no engine needed
        self.config = SimpleNamespace(prefill_chunk_tokens=FULL)
        self.runner = SimpleNamespace(cores=cores)
        self.chunks = SimpleNamespace(
            tokens=lambda step_s: CUT,
            rest_s=lambda items: sum(n for n, _ in items) * pass_s_per_token)
        # 4-token blocks: every pass below (8, 60, 64 tokens) cuts on a block boundary.
        self.kv = SimpleNamespace(layout=SimpleNamespace(block_tokens=4))
        self.cache = SimpleNamespace(num_cached=0)
        self.metrics = PrefillMetrics(CollectorRegistry())
        self.reporter = None
        self._queue = JobQueue()
        self._pushed = asyncio.Event()
        self.removed: list[str] = []  # store keys dropped
        self._hand_on = HandOn(cores, self.metrics.held_handoffs, self.remove, hold_s=0.0)
        self.events: list[tuple[str, ...]] = []

    async def _prepare(self, task: Any) -> None:
        task.seq = SimpleNamespace(num_pending=len(task.job.prompt_token_ids), num_computed=0,
                                   prompt_logprobs=None, block_ids=[])

    async def _step(self, pending: list[Any]) -> list[tuple[Any, list[FirstToken]]]:
        done = []
        shares = self._pass_shares(pending)  # the real sizing, hand-ons due before it first
        self.events.append(("forward", str(sum(shares))))
        for task, n in zip(pending, shares):
            task.seq.num_pending -= n
            task.seq.num_computed += n
            if n and task.seq.num_pending == 0:
                done.append((task, [FirstToken(token_id=7)]))
        return done

    async def remove(self, keys: list[str]) -> None:
        self.removed += keys

    async def _finish(self, task: Any, first: Any) -> PrefillResult:
        return PrefillResult(first_token=first.first_token, request_id=task.job.request_id,
                             tail_key=f"tail/{task.job.request_id}", block_checksums=[],
                             prefill_seconds=0.0)


def job(rid: str, tokens: int, due_s: float | None = 5.0, max_tokens: int = 16) -> PrefillJob:
    return PrefillJob(request_id=rid, prompt_token_ids=[1] * tokens, block_keys=[],
                      sampling=SamplingParams(max_tokens=max_tokens), answer_within_s=due_s)


async def serve(worker: WalkingWorker, jobs: list[PrefillJob],
                gone: tuple[str, str] | None = None) -> dict[str, PrefillResult]:
    """Queue the jobs, serve them; each job's first token and its result are logged. With
    `gone` (a, b), the caller of job a goes away as job b's first token comes."""
    tasks = {}
    for j in jobs:
        def first(_: Any, rid: str = j.request_id) -> None:
            worker.events.append(("first", rid))
            if gone is not None and rid == gone[1]:
                tasks[gone[0]].done.cancel()

        tasks[j.request_id] = PrefillTask(j, Told(worker.events, j.request_id), on_first=first)
        worker._queue.push(tasks[j.request_id])
    await worker._serve()
    await asyncio.sleep(0)  # the store removals it started
    return {rid: t.done.result() for rid, t in tasks.items() if not t.done.cancelled()}


async def test_a_short_prompts_hand_off_waits_while_a_long_one_behind_it_runs_whole() -> None:
    """a (8 tokens) is computed first; b (200) is queued behind it. a's first token goes out at
    once, but handed on then its decode would cut b's passes to 8 tokens beside it: 25 passes
    instead of 4. Held, b runs in passes of 64, and a goes on once b is done (the queue ran)."""
    worker = WalkingWorker(0.001, Cores())
    results = await serve(worker, [job("a", 8), job("b", 200)])
    assert worker.events == [
        ("forward", "8"), ("first", "a"),
        ("forward", "64"), ("forward", "64"), ("forward", "64"), ("forward", "8"),
        ("first", "b"), ("on to the decode", "b"), ("on to the decode", "a")]
    assert results["a"].held_s > 0 and results["b"].held_s == 0


async def test_a_held_hand_off_goes_on_before_a_pass_that_would_end_past_its_time() -> None:
    """a's first token is due in 1.5 s, so it may be held until 1.25 s; b's first whole pass
    would take an estimated 1.6 s. a goes on before that pass, which is then cut beside a's
    decode: a second token held past the pass would come after its deadline."""
    worker = WalkingWorker(0.025, Cores())  # 25 ms a token: 1.6 s for 64
    await serve(worker, [job("a", 8, due_s=HOLD_MARGIN_S + HOLD_MIN_S + 0.75), job("b", 200)])
    assert worker.events[:4] == [("forward", "8"), ("first", "a"), ("on to the decode", "a"),
                                 ("forward", str(CUT))]


@pytest.mark.parametrize("when", ["a", "b"])
async def test_a_job_whose_caller_went_away_leaves_no_tail_in_the_store(when: str) -> None:
    """The client of request a disconnects as its first token comes, or while its hand-off is
    held (at b's first token): no decode reads its prompt's partial last block and the
    conductor never learns the block's key, so the prefill drops it."""
    worker = WalkingWorker(0.001, Cores())
    results = await serve(worker, [job("a", 8), job("b", 200)], gone=("a", when))
    assert list(results) == ["b"]
    assert worker.removed == ["tail/a"]


@pytest.mark.parametrize("case", ["no deadline", "deadline too near", "one token",
                                  "no decode on these cores", "under a cut pass behind"])
async def test_a_job_goes_on_at_once_where_holding_it_would_gain_nothing(case: str) -> None:
    """Without a first-token deadline (no --ttft-slo) there is no time to hold it against; one
    due too soon, one whose answer ends at its first token, one whose decode is on other cores,
    or one with less than a cut pass queued behind it (that runs in one pass anyway) goes on as
    it is answered."""
    a = {"no deadline": job("a", 8, due_s=None),
         "deadline too near": job("a", 8, due_s=HOLD_MARGIN_S + HOLD_MIN_S / 2),
         "one token": job("a", 8, max_tokens=1),
         # a fills the first pass; b, a cut pass long, is all that is left behind it
         "under a cut pass behind": job("a", FULL - 4)}.get(case, job("a", 8))
    b = job("b", CUT if case == "under a cut pass behind" else 200)
    worker = WalkingWorker(0.001, Cores(present=0 if case == "no decode on these cores" else 1))
    results = await serve(worker, [a, b])
    assert worker.events[:3] == [("forward", str(len(a.prompt_token_ids))), ("first", "a"),
                                 ("on to the decode", "a")]
    assert results["a"].held_s == 0


def test_held_jobs_go_on_in_the_order_their_time_comes() -> None:
    now = [10.0]
    held: HandOffs[str] = HandOffs(clock=lambda: now[0])
    assert held.hold_until(None, 500, 8) is None
    assert held.hold_until(15.0, 500, 8) == 15.0 - HOLD_MARGIN_S
    held.hold(13.0, "late")
    held.hold(11.0, "early")
    now[0] = 10.5
    assert held.due(0.4) == []  # ends at 10.9, before either
    # Ends at 11.05: past "early"'s time by less than the estimate's noise; it runs whole.
    assert held.due(0.55) == []
    assert held.due(0.7) == [("early", 0.5)]  # ends at 11.2
    assert held.due(None) == [("late", 0.5)]
    assert len(held) == 0
