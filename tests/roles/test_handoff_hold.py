"""A prefill's pass after a hand-off waits for the decode on its cores to start the handed jobs."""

from __future__ import annotations

import asyncio

from mooncake_server.roles.prefill.handoff_hold import HandoffHold


class Board:
    """The core board as the hold reads it: a decode that starts what it was handed on cue."""

    def __init__(self, present: int = 1) -> None:
        self.present = present
        self.started = 0

    def others_present(self) -> int:
        return self.present

    def others_handed_in(self) -> int:
        return self.started


async def test_the_next_pass_waits_until_the_decode_started_the_handed_sequences() -> None:
    board = Board()
    hold = HandoffHold(board, hold_s=30.0)
    board.started = 5  # sequences handed earlier
    hold.answering()
    hold.answered(2)  # two choices go on to the decode
    waiting = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0.02)
    board.started = 6
    await asyncio.sleep(0.02)
    assert not waiting.done()  # one of the two started
    board.started = 7
    assert await asyncio.wait_for(waiting, 5) < 30.0
    assert await hold.wait() == 0.0  # held once per hand-off


class SteppingClock:
    """Each reading is 10 ms after the last: a hold's polls see time pass, without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


async def test_a_decode_that_never_starts_the_job_holds_the_pass_at_most_the_hold() -> None:
    board, clock = Board(), SteppingClock()
    hold = HandoffHold(board, hold_s=0.05, clock=clock)
    hold.answering()
    answered_at = clock.now
    hold.answered(1)
    assert await asyncio.wait_for(hold.wait(), 5) > 0.0
    assert clock.now - answered_at >= 0.05  # held until the deadline, then let go
    hold.answering()  # nothing started since: perhaps no decode shares these cores
    hold.answered(1)
    assert await hold.wait() == 0.0
    board.started = 1  # a decode on the board started a sequence: hand-offs are held again
    hold.answering()
    answered_at = clock.now
    hold.answered(1)
    assert await asyncio.wait_for(hold.wait(), 5) > 0.0
    assert clock.now - answered_at >= 0.05


async def test_nothing_is_held_alone_on_the_cores_or_when_nothing_goes_to_a_decode() -> None:
    alone = HandoffHold(Board(present=0), hold_s=30.0)
    alone.answering()
    alone.answered(1)
    assert await alone.wait() == 0.0
    beside = HandoffHold(Board(), hold_s=30.0)
    beside.answering()
    beside.answered(0)  # answers that end at their first token
    assert await beside.wait() == 0.0
