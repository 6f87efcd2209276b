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

from mooncake_server.roles.prefill.worker import PrefillWorker, _Task
from mooncake_server.wire.jobs import PrefillJob, SamplingParams

CHUNK = 32


class RecordedWorker(PrefillWorker):
    """The real batch loop; forwards walk CHUNK tokens over the batch, answers are logged."""

    def __init__(self, rest_s: float | None = None) -> None:  # none of the engine is needed
        self.metrics = SimpleNamespace(batch_jobs=SimpleNamespace(observe=lambda n: None))
        self.events: list[tuple[str, list[str]]] = []
        # The rest of a pass takes `rest_s` at the last forward's speed (None: not timed).
        self.chunks = SimpleNamespace(rest_s=lambda items: rest_s)

    async def _prepare(self, task: Any) -> None:
        task.seq = SimpleNamespace(num_pending=len(task.job.prompt_token_ids), num_computed=0)

    async def _step(self, pending: list[Any]) -> list[tuple[Any, list[Any]]]:
        left, done, computed = CHUNK, [], []
        for task in pending:
            if left <= 0:
                break
            n = min(task.seq.num_pending, left)
            task.seq.num_pending -= n
            task.seq.num_computed += n
            left -= n
            computed.append(task.job.request_id)
            if task.seq.num_pending == 0:
                done.append((task, []))
        self.events.append(("forward", computed))
        return done

    async def _answer(self, done: list[tuple[Any, list[Any]]]) -> None:
        if done:
            self.events.append(("answer", [t.job.request_id for t, _ in done]))


def job(rid: str, tokens: int, rank: int, burst_pass: int,
        due_s: float | None = None) -> PrefillJob:
    return PrefillJob(request_id=rid, prompt_token_ids=[1] * tokens, block_keys=[],
                      sampling=SamplingParams(max_tokens=8), burst_at=1000.0, burst_rank=rank,
                      burst_pass=burst_pass, answer_within_s=due_s)


async def run(jobs: list[PrefillJob],
              rest_s: float | None = None) -> list[tuple[str, list[str]]]:
    worker = RecordedWorker(rest_s)
    loop = asyncio.get_running_loop()
    await worker._run_batch([_Task(j, loop.create_future()) for j in jobs])
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
