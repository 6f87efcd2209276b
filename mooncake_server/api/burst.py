"""Admission per burst: requests that arrive together are decided together (the conductor's
scheduler and the colocated engine's admission both decide through a `BurstGate`).

Production arrivals come in bursts (a trace's timestamps in 3-second buckets put 10-16 requests,
thousands of prompt tokens, on the cluster at once). Judged one by one in arrival order, a
burst's first long prompts were accepted, pushed the short ones behind them past their deadline,
and then were late themselves. Here the requests waiting for a decision are gathered for
`window_s`, and for another window while the last one brought more (beside busy decode steps a
burst reaches the gate over tens of ms), never longer than `gather_max_s`; then they are
ordered by the prefill work they need (uncached tokens, fewest first: for one common deadline
that order lets the most requests meet it) and placed in that order, each one's estimate
counting those placed before it; those that cannot meet the SLOs get their 429 at once.
Across bursts the earlier burst goes first (earliest deadline): a later burst is decided with the
earlier one already in the ledger, and its prefill jobs carry the burst's time and each job's rank
(`Order`, ranks counting accepted requests only), which the prefill instance serves its queue
by: it starts rank r once ranks 0..r-1 of its burst have reached it (or after a short wait), since
the jobs reach it in any order (each after its own decode reservation) and a long prompt started
first holds the cores for seconds while the burst's short ones wait behind it. Once the whole
burst is decided, `settle` may revise the results before any request hears its own (the
conductor renumbers ranks per prefill instance and says which of them share the burst's first
pass).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

# Long enough to gather a burst's requests as the API parses and tokenizes them (a few ms each
# here), short against any TTFT SLO. NOTE: at 20 ms, bursts that came while the last one's
# requests decoded were split into two decisions 60-78 ms apart (goodput replays at x2): the
# second one's 1-token prompts were queued behind the first's 444-token one (estimated 2.35 s)
# and its 534-602-token prompts refused behind them.
BURST_WINDOW_S = 0.05
# Beside busy decode steps a burst reaches the gate over tens of ms (the API tokenizes each
# request between steps): the gate gathers while requests keep arriving, a window at a time, but
# never longer than this, so a steady stream is still decided in bounded time.
BURST_GATHER_MAX_S = 0.1

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Order(NamedTuple):
    """Where a prefill job stands in its instance's queue: its burst's time, then its rank."""

    burst_at: float  # wall-clock seconds the burst was decided (comparable across hosts)
    rank: int
    # Ranks 0..pass_ranks-1 of the burst run in one pass: the instance waits for all of them
    # before starting it (a short wait), not only for those ranked before its head.
    pass_ranks: int = 0


class _Waiting(NamedTuple, Generic[T, R]):
    item: T
    cost: float
    arrived: int
    answer: asyncio.Future[R]


class BurstGate(Generic[T, R]):
    """Gathers the items waiting for admission and decides them together, cheapest first."""

    def __init__(self, decide: Callable[[T, Order], R], *, window_s: float = BURST_WINDOW_S,
                 wall_clock: Callable[[], float] = time.time,
                 settle: Callable[[list[R]], list[R]] | None = None,
                 gather_max_s: float = BURST_GATHER_MAX_S) -> None:
        self._decide = decide
        self._settle = settle
        self.window_s = window_s
        self.gather_max_s = gather_max_s
        self._wall_clock = wall_clock
        self._waiting: list[_Waiting[T, R]] = []
        self._arrived = 0
        self._deciding: asyncio.Task[None] | None = None
        self.bursts = 0  # decisions made (each over one or more items)

    async def admit(self, item: T, cost: float) -> R:
        """`decide(item, order)`'s result once its burst is decided (or what it raised)."""
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(item, cost, self._arrived, answer))
        self._arrived += 1
        if self._deciding is None or self._deciding.done():
            self._deciding = asyncio.create_task(self._decide_after_window(),
                                                 name="burst-admission")
        return await answer

    async def _decide_after_window(self) -> None:
        await self._gather()
        burst, self._waiting = self._waiting, []
        self.bursts += 1
        at = self._wall_clock()
        rank = 0  # counts the accepted only: the prefill instance waits for ranks 0..r-1
        decided: list[tuple[_Waiting[T, R], R]] = []
        for w in sorted(burst, key=lambda w: (w.cost, w.arrived)):
            if w.answer.done():  # its client went away while the burst gathered
                continue
            try:
                result = self._decide(w.item, Order(at, rank))
            except Exception as exc:  # noqa: BLE001 - the 429 (or a bug) goes to its request
                w.answer.set_exception(exc)
                continue
            if result is not None:
                rank += 1
            decided.append((w, result))
        results = [r for _, r in decided]
        if self._settle is not None and decided:
            try:
                results = self._settle(results)
            except Exception:  # noqa: BLE001 - a bug there must not leave the burst unanswered
                log.exception("settling a burst failed; its decisions stand as made")
        for (w, _), result in zip(decided, results, strict=True):
            if not w.answer.done():
                w.answer.set_result(result)

    async def _gather(self) -> None:
        """Waits a window, then another while the last one brought requests, up to the cap."""
        if self.window_s <= 0:
            return
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + max(self.window_s, self.gather_max_s)
        seen = -1
        while seen != self._arrived and (left := stop_at - loop.time()) > 0:
            seen = self._arrived
            await asyncio.sleep(min(self.window_s, left))
