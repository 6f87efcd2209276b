"""The prefill instance's waiting jobs, in the order the conductor's admission decided.

Jobs carry their burst's time and their rank in it (`PrefillJob.burst_at`, `burst_rank`): the
cheapest jobs of a burst first, earlier bursts before later ones. A job without them counts as a
burst of its own, decided when it arrived. A job that also carries `start_within_s` and has
waited longer than that is turned away before any work (`LateForSLO`, HTTP 429): started now, it
would miss the TTFT it was admitted under, and the jobs behind it with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from mooncake_server.wire.jobs import PrefillJob


class LateForSLO(Exception):
    """The job waited past the start its TTFT SLO allowed: refused before any work (429)."""


class Waiting(Protocol):
    """What the queue needs of a waiting job."""

    job: PrefillJob
    queued_at: float  # perf_counter seconds
    queued_wall: float  # time.time() seconds

    def gone(self) -> bool:
        """Its caller went away (or it was answered) while it waited."""
        ...


class JobQueue:
    """Waiting prefill jobs, taken by (burst, rank); late ones set aside."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._jobs: list[Waiting] = []
        self._clock = clock

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Waiting]:
        return iter(self._jobs)

    def push(self, task: Waiting) -> None:
        """A job arrived."""
        self._jobs.append(task)

    @staticmethod
    def _order(task: Waiting) -> tuple[float, int]:
        job = task.job
        return (job.burst_at if job.burst_at is not None else task.queued_wall, job.burst_rank)

    def take(self, budget_tokens: int) -> tuple[list[Waiting], list[Waiting]]:
        """The next batch (the first job in order, and those after it that fit in
        `budget_tokens` prompt tokens beside it) and the jobs found late on the way."""
        self._jobs.sort(key=self._order)
        batch: list[Waiting] = []
        late: list[Waiting] = []
        tokens = 0
        now = self._clock()
        while self._jobs:
            task = self._jobs[0]
            if task.gone():
                self._jobs.pop(0)
                continue
            within = task.job.start_within_s
            if within is not None and now - task.queued_at > within:
                late.append(self._jobs.pop(0))
                continue
            n = len(task.job.prompt_token_ids)
            if batch and tokens + n > budget_tokens:
                break
            batch.append(self._jobs.pop(0))
            tokens += n
        return batch, late
