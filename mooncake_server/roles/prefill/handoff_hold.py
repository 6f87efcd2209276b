"""A prefill's next pass waits for the decode on its cores to start the jobs it just handed on.

Under `--role all` the prefill and the decode take turns on the same cores. A pass begun as soon
as a job was answered held the cores while that job's KV travelled to the decode (result, decode
job, KV load: 25-70 ms), so the job's second token waited for the whole pass and then a step:
hand-off gaps of 150-250 ms (p90 207 ms) in a replay of the paper's trace at time scale 6, where
a step took 40-60 ms. Held until the decode says (on the core board) that it started the handed
sequences, the pass follows that step instead: p90 134 ms in the same replay.
A decode that refuses the job, or one on other cores, is waited for at most `HANDOFF_HOLD_S`;
after a hold in which no decode on the board started anything, the next hand-offs are not held
until one does (a board shared by prefills alone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

# The decode job's way and one decode step, with room for a step already running.
HANDOFF_HOLD_S = 0.3
_POLL_S = 0.002


class HandoffBoard(Protocol):
    """What the hold reads of the core board (engine/core_budget.py)."""

    def others_present(self) -> int:
        """Engine processes other than this one on these cores."""
        ...

    def others_handed_in(self) -> int:
        """Handed-in sequences the other engine processes have started."""
        ...

    def others_active(self) -> int:
        """Engine processes other than this one that have work now."""
        ...


# A job answered here is handed to a decode, which takes about this long to start stepping
# (decode job, KV load). A pass begun meanwhile at full size would hold the cores for seconds
# while that decode waits for its first step: the replay's longest hand-off gaps (1 s for a
# 707-token prompt's two tokens, on the 2-core AMD machine).
HANDOFF_GRACE_S = 1.0


def decode_beside(cores: HandoffBoard, answered_at: float, now: float) -> bool:
    """A decode on these cores has work, or is about to: it takes the job answered at
    `answered_at` (monotonic seconds)."""
    if cores.others_active():
        return True
    return now - answered_at < HANDOFF_GRACE_S and bool(cores.others_present())


class HandoffHold:
    """Holds the pass after a hand-off until the decode beside started the handed sequences."""

    def __init__(self, board: HandoffBoard, hold_s: float = HANDOFF_HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.board = board
        self.hold_s = hold_s
        self._clock = clock
        self._started = 0
        self._target: tuple[int, float] | None = None  # (started count to reach, deadline)
        self._stalled_at: int | None = None  # the count a hold ended at without any progress

    def answering(self) -> None:
        """Jobs are about to be answered: no decode can have started them yet."""
        self._started = self.board.others_handed_in()

    def answered(self, sequences: int) -> None:
        """`sequences` go on to a decode (choices that decode past their first token)."""
        if not sequences or not self.board.others_present() or self._started == self._stalled_at:
            return
        self._stalled_at = None
        self._target = (self._started + sequences, self._clock() + self.hold_s)

    async def wait(self) -> float:
        """Before a pass: wait for the decode to start the last hand-off; seconds waited."""
        if self._target is None:
            return 0.0
        (target, deadline), self._target = self._target, None
        began = self._clock()
        while (now := self.board.others_handed_in()) < target and self._clock() < deadline:
            await asyncio.sleep(_POLL_S)
        if now == self._started:
            self._stalled_at = now
        return self._clock() - began
