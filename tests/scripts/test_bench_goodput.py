"""bench_goodput's bursty trace and its offline bound on served requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mooncake_bench import goodput_bound as gb

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bg() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    import bench_goodput

    return bench_goodput


def test_timestamps_fall_into_three_second_buckets(bg: ModuleType, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": ts, "input_length": 600,
                                         "output_length": 10, "hash_ids": [i, i + 100]}) + "\n"
                             for i, ts in enumerate((0, 1200, 2999, 3000, 7400))))
    got = bg.bursty_trace(trace, 4)
    assert [r.timestamp_ms for r in got] == [0.0, 0.0, 0.0, 3000.0]


def prefill_only(per_token_s: float) -> gb.Costs:
    """Prefill at a flat per-token cost; requests asking for one token never decode."""
    return gb.Costs(0.0, per_token_s, 0.0, 0.05, 0.0)


def ask(*tokens: int, outputs: int = 1) -> list[gb.Request]:
    return [gb.Request(n, outputs) for n in tokens]


def test_the_bound_keeps_a_bursts_shortest_requests_and_carries_the_backlog() -> None:
    # 1 ms per token, 1 s TTFT SLO. Burst at 0 s: 900 + 300 + 200 + 400 tokens: the three
    # shortest fit (0.9 s), the 900 does not. Burst at 1 s: starts at once (0.9 < 1.0),
    # 500 + 600: only the 500 fits.
    bursts = {0.0: ask(900, 300, 200, 400), 1.0: ask(600, 500)}
    assert gb.best_served(bursts, prefill_only(1e-3), 1.0, 0.2) == 4
    # Backlog: a burst arriving while the earlier one's kept work still runs waits for it.
    assert gb.best_served({0.0: ask(700), 0.5: ask(500)}, prefill_only(1e-3), 0.8, 0.2) == 2
    assert gb.best_served({0.0: ask(750), 0.5: ask(600)}, prefill_only(1e-3), 0.8, 0.2) == 1


def test_a_bursts_decoding_takes_the_cores_from_the_next_bursts_prefill() -> None:
    # The first request's 40 decode steps (50 ms each) run until 2.5 s; while the second
    # burst's 900-token prompt waits, they step once per 200 ms TBT SLO and take a quarter of
    # the machine: 0.9 s of prefill needs 1.2 s, past its 1 s TTFT SLO.
    costs = gb.Costs(0.0, 1e-3, 0.0, 0.05, 0.0)
    short = {0.0: ask(500, outputs=1), 1.0: ask(900)}
    long = {0.0: ask(500, outputs=41), 1.0: ask(900)}
    assert gb.best_served(short, costs, 1.0, 0.2) == 2
    assert gb.best_served(long, costs, 1.0, 0.2) == 1


def test_the_bound_drops_an_early_request_when_its_decoding_would_cost_two_later_ones() -> None:
    # Kept, the 400-token request decodes for 5 s at 100 ms a step, halving the prefill speed
    # of the burst at 0.5 s: one of its three 300-token prompts fits. Dropped, all three do.
    costs = gb.Costs(0.0, 1e-3, 0.0, 0.1, 0.0)
    bursts = {0.0: ask(400, outputs=51), 0.5: ask(300, 300, 300)}
    assert gb.best_served(bursts, costs, 1.0, 0.2) == 3


def test_a_pass_pays_its_fixed_cost_once_and_each_prompt_its_own_attention() -> None:
    costs = gb.Costs(0.1, 1e-3, 1e-6, 0.05, 0.0)
    # Two 600-token prompts in one pass: 0.1 + 2 * (0.6 + 0.36) = 2.02 s; one alone 1.06 s.
    assert gb.best_served({0.0: ask(600, 600)}, costs, 2.0, 0.2) == 1
    assert gb.best_served({0.0: ask(600, 600)}, costs, 2.05, 0.2) == 2


def test_costs_are_fit_from_measured_points() -> None:
    samples = [(n, 0.05 + 1.5e-3 * n + 2e-7 * n * n) for n in (128, 512, 1024, 2048)]
    fixed, per_token, pair = gb.fit_prefill(samples)
    assert fixed == pytest.approx(0.05, abs=1e-6)
    assert per_token == pytest.approx(1.5e-3, rel=1e-6)
    assert pair == pytest.approx(2e-7, rel=1e-6)
    # Noise that would fit a negative fixed cost drops the term instead.
    assert min(gb.fit_prefill([(100, 0.1), (200, 0.21), (400, 0.43)])) >= 0.0
    assert gb.fit_decode([(1, 0.02), (8, 0.034)]) == pytest.approx((0.018, 0.002))
