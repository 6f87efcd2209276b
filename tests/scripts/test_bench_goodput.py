"""bench_goodput's bursty trace and its offline bound on served requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

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


def test_the_bound_keeps_a_bursts_shortest_requests_and_carries_the_backlog(
        bg: ModuleType) -> None:
    # 1 ms per token, 1 s TTFT SLO. Burst at 0 s: 900 + 300 + 200 + 400 tokens: the three
    # shortest fit (0.9 s), the 900 does not. Burst at 1 s: starts at once (0.9 < 1.0),
    # 500 + 600: only the 500 fits.
    bursts = {0.0: [900, 300, 200, 400], 1.0: [600, 500]}
    assert bg.offline_bound(bursts, 1e-3, 1.0) == 4
    # Backlog: a burst arriving while the earlier one's kept work still runs waits for it.
    assert bg.offline_bound({0.0: [700], 0.5: [500]}, 1e-3, 0.8) == 2  # 0.7 + 0.5 = 1.2 s
    assert bg.offline_bound({0.0: [750], 0.5: [600]}, 1e-3, 0.8) == 1  # 1.35 s > 1.3 s
