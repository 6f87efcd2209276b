"""The prefill instance's waiting jobs, in the order the conductor's admission decided.

Jobs carry their burst's time and their rank in it (`PrefillJob.burst_at`, `burst_rank`): the
cheapest jobs of a burst first, earlier bursts before later ones. A job without them counts as a
burst of its own, decided when it arrived. Rank r of a burst waits until ranks 0..r-1 have arrived
(at most `ORDER_WAIT_S`), and the ranks that share the burst's first pass (`burst_pass`) wait for
one another the same way: the jobs reach the instance in any order, and a long one started first
held the cores for seconds while the burst's short ones waited behind it (a replay's cheapest
requests, estimated at 0.02-0.8 s, answered at 3.7 s). A job that also carries
`start_within_s` and has waited longer than that is turned away before any work (`LateForSLO`,
HTTP 429): started now, it would miss the TTFT it was admitted under, and the jobs behind it
with it. Unless the instance, at the speed its passes ran lately, still finds it in time
(`JobQueue.take`'s `in_time`): the conductor set that start from its estimate at placing, which
for passes beside a decode not timed yet is a prior.
A first pass is taken whole, even past the chunk (the conductor sizes it by the TTFT SLO): the
worker runs it as forwards of a chunk back to back and answers its jobs when the last one ends,
as the conductor predicted; answered at the first forward's end, the decode of those requests
would have cut the rest of the pass into short passes beside it. Unless holding them would make
them late: a pass running past its jobs' first-token deadline answers the ones it has computed
(`first_pass_late`). A pass's tail (`PrefillJob.pass_tail`) runs in a forward of its own after
the others', and only if it would still end in time (`tail_late`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from mooncake_server.engine.kv_cache import prompt_cut
from mooncake_server.wire.jobs import PrefillJob

# The longest a job waits for the jobs ranked before it in its burst (a refused or cancelled
# one never comes); a decode reservation round trip is a few milliseconds.
ORDER_WAIT_S = 0.2
_BURSTS_KEPT = 256  # bursts whose arrived ranks are remembered


def same_first_pass(a: PrefillJob, b: PrefillJob) -> bool:
    """Both jobs are ranks of one burst's first pass on this instance."""
    return (a.burst_at is not None and a.burst_at == b.burst_at
            and a.burst_rank < a.burst_pass and b.burst_rank < b.burst_pass)


def first_pass_late(dues: Sequence[float | None], rest_s: float | None, now: float) -> float:
    """Seconds past the earliest of `dues` (the first-token deadlines of a first pass's jobs
    computed so far) that the pass would answer them, its rest taking `rest_s` from `now`; 0.0
    when it ends in time or either is unknown.

    Past 0.0 the worker answers them at once: the rest of the pass is then cut beside their
    decoding and its prompts end later, but they were late anyway. Held, a pass that ran 1.15x
    its estimate (the host slower than 12 s before) answered all ten of its jobs at 5.07 s
    against a 5 s TTFT SLO; nine had been computed by its first forward, at 3.76 s.
    """
    due = min((d for d in dues if d is not None), default=None)
    if due is None or rest_s is None:
        return 0.0
    return max(0.0, now + rest_s - due)


def forward_shares(pending: Sequence[tuple[int, bool, int]], chunk_tokens: int,
                   block_tokens: int) -> list[int]:
    """How many tokens of each pending job (its tokens left; whether it is a first pass's
    tail not started yet; the position it resumes at) the next forward of at most
    `chunk_tokens` computes, oldest first: a prompt cut short is cut on a block boundary
    (`prompt_cut`), and a tail only in a forward of its own, so that it can still be turned
    away once the others' forwards have run (`tail_late`)."""
    shares, left = [], chunk_tokens
    for pending_tokens, tail, start in pending:
        if tail and left < chunk_tokens:
            take = 0
        else:
            take = prompt_cut(start, pending_tokens, left, block_tokens,
                              first=left == chunk_tokens)
        shares.append(take)
        left -= take
    return shares


# NOTE: how much slower than the forwards just before it a first pass's tail may run and still
# be started: the host's speed moves between passes, as the conductor's FIRST_PASS_DRIFT
# allows for (one burst's pass ran 1.02x its estimate, a later one 1.09x).
TAIL_DRIFT = 1.1


def tail_late(dues: Sequence[float | None], rest_s: float | None, now: float) -> float:
    """Seconds past the earliest of `dues` (the first-token deadlines of a first pass's tail
    and of the jobs it holds) that the tail would end if started `now`, its forward taking
    `rest_s` (at the speed the pass's forwards ran) times `TAIL_DRIFT`; 0.0 when in time.

    Past 0.0 the tail is turned away before any work (429) and the held jobs answered: the
    conductor let it in past the pass's usual share of the SLO on that condition
    (conductor/scheduler/bursts.py, `TAIL_SLO_SHARE`).
    """
    return first_pass_late(dues, None if rest_s is None else rest_s * TAIL_DRIFT, now)


# NOTE: how far past a member's estimated first token a forward may end, as a share of the time
# left to it (the estimates' own spread). Packed by tokens alone, a replay's (x2) 2-9 token
# prompts, estimated at 0.18-0.36 s in cut passes beside a decode that then went idle, ran in
# one 1,958-token forward with two 450-token ones and two more, all answered at 3.01 s.
PACK_SLACK = 1.15


def joins_forward(dues: Sequence[float | None], pass_s: float | None, added_s: float,
                  fixed_s: float, now: float) -> bool:
    """Whether a job joins the forward of the jobs before it. With it the forward takes
    `pass_s` from `now`, `added_s` of that for its tokens, `fixed_s` being a forward's fixed
    cost. It joins if the forward still answers every member by its estimated first token
    (`dues`, perf_counter times; give or take `PACK_SLACK` of the time left), or if a forward
    of its own would cost the rest more than it adds; always, with no speed or no estimate."""
    due = min((d for d in dues if d is not None), default=None)
    if due is None or pass_s is None:
        return True
    return pass_s <= PACK_SLACK * (due - now) or added_s <= fixed_s


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
        self._arrived: dict[float, set[int]] = {}  # burst -> ranks that reached the queue
        self.hold_s = 0.0  # after a `take` that returned nothing: how long until it may

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Waiting]:
        return iter(self._jobs)

    def tokens(self) -> int:
        """Prompt tokens of the waiting jobs (cached ones counted too: an upper bound)."""
        return sum(len(t.job.prompt_token_ids) for t in self._jobs if not t.gone())

    def push(self, task: Waiting) -> None:
        """A job arrived."""
        self._jobs.append(task)
        job = task.job
        if job.burst_at is not None:
            self._arrived.setdefault(job.burst_at, set()).add(job.burst_rank)
            while len(self._arrived) > _BURSTS_KEPT:
                del self._arrived[min(self._arrived)]

    def _waits_for_earlier(self, task: Waiting, now: float) -> float:
        """Seconds the job still waits for its burst's earlier ranks, or for every rank of the
        first pass it belongs to (0.0: none)."""
        job = task.job
        if job.burst_at is None:
            return 0.0
        needed = max(job.burst_rank, job.burst_pass)
        arrived = self._arrived.get(job.burst_at, set())
        if all(r in arrived for r in range(needed)):
            return 0.0
        return max(0.0, ORDER_WAIT_S - (now - task.queued_at))

    @staticmethod
    def _order(task: Waiting) -> tuple[float, int]:
        job = task.job
        return (job.burst_at if job.burst_at is not None else task.queued_wall, job.burst_rank)

    def take(self, budget_tokens: int, in_time: Callable[[Waiting], bool] | None = None,
             packs: Callable[[list[Waiting]], bool] | None = None
             ) -> tuple[list[Waiting], list[Waiting]]:
        """The next batch (the first job in order, and those after it that fit in
        `budget_tokens` prompt tokens beside it and, computed with it, would still be answered
        about when the conductor estimated (`packs`), or share its burst's first pass) and the
        jobs found late on the way. An empty batch with `hold_s` > 0: the first job waits for
        its burst's earlier ranks.

        A job past its start deadline that would head the batch is asked about once more
        (`in_time`: it would still end by its first token's deadline if started now, alone);
        if so it is the batch, alone, as that judgement assumed."""
        self._jobs.sort(key=self._order)
        batch: list[Waiting] = []
        late: list[Waiting] = []
        tokens = 0
        self.hold_s = 0.0
        now = self._clock()
        while self._jobs:
            task = self._jobs[0]
            if task.gone():
                self._jobs.pop(0)
                continue
            within = task.job.start_within_s
            if within is not None and now - task.queued_at > within:
                if not batch and in_time is not None and in_time(task):
                    batch.append(self._jobs.pop(0))
                    break
                late.append(self._jobs.pop(0))
                continue
            n = len(task.job.prompt_token_ids)
            if batch and not same_first_pass(batch[0].job, task.job) and (
                    tokens + n > budget_tokens or (packs is not None and not packs([*batch, task]))):
                break
            if not batch:
                self.hold_s = self._waits_for_earlier(task, now)
                if self.hold_s > 0:
                    break
            batch.append(self._jobs.pop(0))
            tokens += n
        return batch, late
