"""The burst gate gathers a burst that trickles in as one decision, and never gathers forever."""

from __future__ import annotations

import asyncio

from mooncake_server.api.burst import BurstGate, Order


async def test_a_burst_that_trickles_in_is_decided_as_one_cheapest_first() -> None:
    """Beside busy decode steps a burst's requests reach the gate a few ms apart, over longer in
    all than one window: they are still decided together, the cheapest first."""
    ranks: dict[str, int] = {}

    def decide(item: str, order: Order) -> str:
        ranks[item] = order.rank
        return item

    gate: BurstGate[str, str] = BurstGate(decide, window_s=0.05, gather_max_s=10.0)

    async def arrive(i: int, cost: float) -> str:
        await asyncio.sleep(0.01 * i)  # ten arrivals over 90 ms: two windows' worth
        return await gate.admit(f"r{i}", cost)

    costs = [900, 800, 700, 600, 500, 400, 300, 200, 100, 50]
    answers = await asyncio.gather(*(arrive(i, c) for i, c in enumerate(costs)))
    assert answers == [f"r{i}" for i in range(10)]
    assert gate.bursts == 1
    # The last to arrive was the cheapest: it goes first.
    assert [ranks[f"r{i}"] for i in range(10)] == list(reversed(range(10)))


async def test_by_default_arrivals_tens_of_ms_apart_are_one_burst() -> None:
    """Beside a busy decode a burst's requests reached the gate tens of ms apart; with the
    default window they are still one decision (split, the later ones queued behind the first
    decision's long prompt and were refused)."""
    gate: BurstGate[int, int] = BurstGate(lambda item, order: order.rank)

    async def arrive(i: int) -> int:
        await asyncio.sleep(0.03 * i)  # 0, 30 and 60 ms: each within a window of the last
        return await gate.admit(i, float(i))

    assert await asyncio.gather(*(arrive(i) for i in range(3))) == [0, 1, 2]
    assert gate.bursts == 1


async def test_a_steady_stream_is_still_decided_within_the_cap() -> None:
    """Requests every 5 ms never leave a quiet window; the gate decides anyway once the cap is
    spent, so the first request is answered while the stream still runs."""
    gate: BurstGate[int, int] = BurstGate(lambda item, order: item, window_s=0.02,
                                          gather_max_s=0.1)
    first = asyncio.ensure_future(gate.admit(0, 1.0))
    rest: list[asyncio.Future[int]] = []
    while not first.done() and len(rest) < 400:  # 400 arrivals: 2 s, twenty caps
        await asyncio.sleep(0.005)
        rest.append(asyncio.ensure_future(gate.admit(len(rest) + 1, 1.0)))
    assert first.done() and await first == 0
    assert len(rest) < 400
    assert await asyncio.gather(*rest) == list(range(1, len(rest) + 1))
    assert gate.bursts >= 1


async def test_without_a_window_nothing_waits() -> None:
    """A zero window (tests, scripted schedulers) decides what has arrived at the next turn."""
    gate: BurstGate[int, int] = BurstGate(lambda item, order: order.rank, window_s=0.0)
    got = await asyncio.gather(gate.admit(7, 2.0), gate.admit(8, 1.0))
    assert got == [1, 0] and gate.bursts == 1
