"""The prefill worker's batch loop: a burst's first pass that spans several forwards is answered
once, when its last forward ends (as the conductor predicted it); any other batch answers each
job as soon as its prompt is computed.

The loop is the real `PrefillWorker._run_batch`; its forward (`_step`, here a chunked walk over
the prompts' token counts), store work (`_prepare`) and answers (`_answer`) are recorded in
order instead of run, so the test reads what the decode would see: which requests were handed
on after which forward.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_server.roles.prefill.job_queue import JobQueue, LateForSLO, forward_shares
from mooncake_server.roles.prefill.task import PrefillTask
from mooncake_server.roles.prefill.worker import PrefillWorker
from mooncake_server.wire.jobs import PrefillJob, SamplingParams

CHUNK = 32
BLOCK = 4  # KV block tokens: every cut below falls on a boundary


class RecordedWorker(PrefillWorker):
    """The real batch loop; forwards walk CHUNK tokens over the batch, answers are logged."""

    def __init__(self, rest_s: float | None = None) -> None:  # none of the engine is needed
        self.metrics = SimpleNamespace(batch_jobs=SimpleNamespace(observe=lambda n: None))
        self.events: list[tuple[str, list[str]]] = []
        # The rest of a pass takes `rest_s` at the last forward's speed (None: not timed).
        self.chunks = SimpleNamespace(rest_s=lambda items: rest_s)
        self.released: list[int] = []  # KV blocks given back by jobs that failed
        self.cache = SimpleNamespace(release=self.released.extend)
        self._queue = JobQueue()

    async def _prepare(self, task: Any) -> None:
        task.seq = SimpleNamespace(num_pending=len(task.job.prompt_token_ids), num_computed=0,
                                   block_ids=[len(task.job.prompt_token_ids)])

    async def _step(self, pending: list[Any]) -> list[tuple[Any, list[Any]]]:
        done, computed = [], []
        shares = forward_shares([(t.seq.num_pending, t.job.pass_tail and not t.passes,
                                  t.seq.num_computed) for t in pending], CHUNK, BLOCK)
        for task, n in zip(pending, shares):
            if not n:
                continue
            task.seq.num_pending -= n
            task.seq.num_computed += n
            task.passes += 1
            computed.append(task.job.request_id)
            if task.seq.num_pending == 0:
                done.append((task, []))
        self.events.append(("forward", computed))
        return done

    async def _answer(self, done: list[tuple[Any, list[Any]]], behind_tokens: int = 0) -> None:
        if done:
            self.events.append(("answer", [t.job.request_id for t, _ in done]))


def job(rid: str, tokens: int, rank: int, burst_pass: int,
        due_s: float | None = None, tail: bool = False) -> PrefillJob:
    return PrefillJob(request_id=rid, prompt_token_ids=[1] * tokens, block_keys=[],
                      sampling=SamplingParams(max_tokens=8), burst_at=1000.0, burst_rank=rank,
                      burst_pass=burst_pass, answer_within_s=due_s, pass_tail=tail)


async def run(jobs: list[PrefillJob], rest_s: float | None = None,
              worker: RecordedWorker | None = None) -> list[tuple[str, list[str]]]:
    worker = worker or RecordedWorker(rest_s)
    loop = asyncio.get_running_loop()
    await worker._run_batch([PrefillTask(j, loop.create_future()) for j in jobs])
    return worker.events


async def test_a_first_pass_over_two_forwards_is_answered_after_the_last() -> None:
    # 10 + 14 + 20 tokens: the first forward computes a, b and 8 of c; c ends in the second.
    events = await run([job("a", 10, 0, 3), job("b", 14, 1, 3), job("c", 20, 2, 3)])
    assert events == [("forward", ["a", "b", "c"]), ("forward", ["c"]),
                      ("answer", ["a", "b", "c"])]


async def test_a_batch_of_no_first_pass_answers_each_job_when_it_is_computed() -> None:
    # Answered at once, a and b go to the decode while c is still computed.
    events = await run([job("a", 10, 0, 0), job("b", 14, 1, 0), job("c", 20, 2, 0)])
    assert events == [("forward", ["a", "b", "c"]), ("answer", ["a", "b"]),
                      ("forward", ["c"]), ("answer", ["c"])]


async def test_a_first_pass_running_late_answers_the_jobs_it_has_computed() -> None:
    """Held for the rest of a pass that would end past their first token's deadline, a and b
    would be late with c; answered after the first forward, only c may be."""
    late = [job("a", 10, 0, 3, due_s=5.0), job("b", 14, 1, 3, due_s=5.0),
            job("c", 20, 2, 3, due_s=5.0)]
    assert await run(late, rest_s=30.0) == [
        ("forward", ["a", "b", "c"]), ("answer", ["a", "b"]), ("forward", ["c"]),
        ("answer", ["c"])]
    # A rest that ends in time, or one not timed yet, holds them for the pass as before.
    for rest in (1.0, None):
        assert await run(late, rest_s=rest) == [
            ("forward", ["a", "b", "c"]), ("forward", ["c"]), ("answer", ["a", "b", "c"])]


async def test_a_first_pass_tail_runs_in_a_forward_of_its_own_and_only_if_in_time() -> None:
    """c, the pass's tail, let in past its usual share of the SLO: a and b fill the first
    forward without it (16 + 8 of 32 tokens), then c runs alone, and all three answer at the
    end. If the pass ran slow (c would end past its deadline at the speed it ran), c is turned
    away with 429 before any work, its KV blocks given back, and a and b answered at once."""
    jobs = [job("a", 16, 0, 3, due_s=5.0), job("b", 8, 1, 3, due_s=5.0),
            job("c", 20, 2, 3, due_s=5.0, tail=True)]
    in_time = await run(jobs, rest_s=1.0)
    assert in_time == [("forward", ["a", "b"]), ("forward", ["c"]),
                       ("answer", ["a", "b", "c"])]
    # 4.6 s would end in time, but not 10% slower than the pass ran: not started.
    slow = RecordedWorker(rest_s=4.6)
    loop = asyncio.get_running_loop()
    tasks = [PrefillTask(j, loop.create_future()) for j in jobs]
    await slow._run_batch(tasks)
    assert slow.events == [("forward", ["a", "b"]), ("answer", ["a", "b"])]
    with pytest.raises(LateForSLO, match="not started"):
        tasks[2].done.result()
    assert slow.released == [20] and tasks[2].seq.block_ids == []
