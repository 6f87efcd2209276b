"""A prefill's answered jobs wait to go on to the decode beside it while prompts are still queued.

Under `--role all` a prefill and a decode take turns on the same cores, and while the decode has
work every prefill pass is cut to what the TBT SLO leaves after the decode's step
(chunk_budget.py). Cut, prompts crawl: on the 2-core AMD machine a 453-token prompt ran at 263
tokens/s beside a decode, against about 570 alone (goodput replay, x2). A burst's short prompts,
answered first, decoded beside its long ones, which then ran cut throughout: a 489-token prompt
was answered 5.06 s after it came (5 s TTFT SLO) and the next one, 542 tokens, was refused.

A request's first token is the prefill's; its second is due within the TTFT and TBT SLOs of its
arrival (scheduler/outcomes.py), after the hand-off. So a job answered while more than one cut
pass of prompt tokens is still queued behind it gets its first token to the caller at once
(`on_first`), but its result, which sends it on to the decode, waits until the queue has run
(`HandOffs.due` with no pass left), or until `HOLD_MARGIN_S` before its first token's deadline.
Meanwhile the decode idles and the queued prompts run whole. A pass that would end past a held
job's time (by more than `HOLD_OVERRUN_S`) hands it on before it starts, so that pass is cut
beside the decode again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prometheus_client import Histogram

from mooncake_server.cost_model.passes import HOLD_MARGIN_S
from mooncake_server.roles.prefill.handoff_hold import (
    HANDOFF_HOLD_S,
    HandoffBoard,
    HandoffHold,
    decode_beside,
)
from mooncake_server.store_client.client import StoreError
from mooncake_server.wire.jobs import PrefillResult

log = logging.getLogger(__name__)

# Shorter holds save less than the hand-off they delay.
HOLD_MIN_S = 0.5
# NOTE: how far past a held job's time a pass may be estimated to end and still run whole, the
# job going on after it: the estimate's noise. The conductor lets a prompt in behind held jobs
# on its own estimate that its passes end `HOLD_MARGIN_S` before the SLO; a 743-token prompt
# estimated so at 4.75 s was estimated here, as its pass began, to end 0.05 s past the held
# jobs' time. They went on, its pass was cut into 15 beside their decoding, and it was answered
# at 6.07 s (goodput replay, x4, Intel AMX machine). Handed on 0.1 s late, a held job still has
# 0.15 s and the TBT SLO for its decode job, KV load and step.
HOLD_OVERRUN_S = 0.1

T = TypeVar("T")


@dataclass(order=True)
class _Held(Generic[T]):
    until: float  # perf_counter() time it goes on at the latest
    answered: float = field(compare=False)
    job: T = field(compare=False)


class HandOffs(Generic[T]):
    """Answered jobs whose hand-on to the decode waits for the prompts queued behind them."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._held: list[_Held[T]] = []
        self._clock = clock

    def __len__(self) -> int:
        return len(self._held)

    def hold_until(self, answer_by: float | None, behind_tokens: int,
                   cut_tokens: int) -> float | None:
        """The time a job answered now may be held until (None: hand it on now): it has a first
        token deadline far enough off, and more than a cut pass of prompt tokens waits behind
        it (less runs in one pass anyway)."""
        if answer_by is None or behind_tokens <= cut_tokens:
            return None
        until = answer_by - HOLD_MARGIN_S
        return until if until - self._clock() >= HOLD_MIN_S else None

    def hold(self, until: float, job: T) -> None:
        """Keep a job's hand-on until `until` at the latest."""
        self._held.append(_Held(until, self._clock(), job))
        self._held.sort()

    def due(self, pass_s: float | None = None) -> list[tuple[T, float]]:
        """The jobs to send on now, with the seconds each was held: those whose time would
        pass, by more than `HOLD_OVERRUN_S`, during a pass of `pass_s` starting now, or every
        one (None: no pass follows, or its length is unknown). The pass is judged at its
        estimate, as the conductor judged it (scheduler/policy.py): one that runs over delays a
        second token that still has the margin and the TBT SLO."""
        now = self._clock()
        ends = None if pass_s is None else now + pass_s - HOLD_OVERRUN_S
        going = [h for h in self._held if ends is None or h.until <= ends]
        self._held = self._held[len(going):]  # sorted by `until`
        return [(h.job, now - h.answered) for h in going]


@dataclass
class Answer:
    """A computed job's result, for its caller (which sends it on to its decode)."""

    done: asyncio.Future[PrefillResult]
    result: PrefillResult
    sequences: int  # choices that go on to a decode past their first token
    answer_by: float | None  # perf_counter() time its first token is due


class HandOn:
    """Answers computed jobs' callers: at once, or held while prompts behind them run whole; and
    what the prefill's passes learn of the decode beside it from that."""

    def __init__(self, cores: HandoffBoard, held_seconds: Histogram,
                 remove: Callable[[list[str]], Awaitable[None]], *,
                 hold_s: float = HANDOFF_HOLD_S) -> None:
        self.cores = cores
        # Store keys of a job whose caller went away before its result: no decode will read its
        # tail block, and no conductor knows to drop it (it never got the result).
        self._remove = remove
        self._removing: set[asyncio.Task[None]] = set()
        self.hold = HandoffHold(cores, hold_s)  # the next pass waits for the decode to start
        self._held: HandOffs[Answer] = HandOffs()
        self._held_seconds = held_seconds
        self._answered_at = float("-inf")  # monotonic time jobs were last handed on

    def __len__(self) -> int:
        return len(self._held)

    def send(self, answers: list[Answer], behind_tokens: int, cut_tokens: int) -> None:
        """Answer the jobs, holding those whose decode would cut the `behind_tokens` prompt
        tokens still queued (passes of `cut_tokens` beside a decode)."""
        going = []
        for answer in answers:
            until = (self._held.hold_until(answer.answer_by, behind_tokens, cut_tokens)
                     if answer.sequences and self.cores.others_present()
                     and not answer.done.done() else None)
            if until is None:
                going.append(answer)
            else:
                self._held.hold(until, answer)
        self._send_now(going)

    def due(self, pass_s: float | None) -> bool:
        """Before a pass of `pass_s` (None: no pass follows, or its length is unknown), send on
        the held jobs whose time it would pass, their results saying how long they were held;
        whether any went."""
        going = []
        for answer, held_s in self._held.due(pass_s):
            self._held_seconds.observe(held_s)
            answer.result = answer.result.model_copy(update={"held_s": held_s})
            going.append(answer)
        self._send_now(going)
        return bool(going)

    def beside_decode(self) -> bool:
        """A decode on these cores has work, or is about to take the jobs just sent on."""
        return decode_beside(self.cores, self._answered_at, time.monotonic())

    def idle(self) -> None:
        """No job is queued: a prompt that comes next (a chat's next turn) runs at full speed."""
        self._answered_at = float("-inf")

    def _send_now(self, going: list[Answer]) -> None:
        if not going:  # the queue ran with nothing held: no hand-off for the next pass to wait
            return
        self.hold.answering()
        handed = 0  # sequences that go on to a decode
        for answer in going:
            if not answer.done.done():
                answer.done.set_result(answer.result)
                handed += answer.sequences
            elif answer.result.tail_key is not None:
                task = asyncio.ensure_future(self._drop_tail(answer.result.tail_key))
                self._removing.add(task)
                task.add_done_callback(self._removing.discard)
        if handed:
            self._answered_at = time.monotonic()
        self.hold.answered(handed)

    async def _drop_tail(self, key: str) -> None:
        try:
            await self._remove([key])
        except StoreError as exc:  # it ages out of the store like any unpinned block
            log.warning("dropping %s, whose caller went away: %s", key, exc)
