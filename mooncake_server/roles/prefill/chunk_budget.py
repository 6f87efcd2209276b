"""How many prompt tokens a prefill pass may carry while a decode on the same cores has work.

On one machine a decode's token gap is its own step plus the prefill pass it waited behind (the
processes take turns on the cores, engine/core_budget.py). With --decode-chunk alone (256
tokens: ~0.25 s on the 2-core AMX machine here) every gap that straddled a pass broke a 200 ms
TBT SLO, and a request's TBT is the mean of its longest tenth of gaps, so a few such gaps are
enough. With --tbt-slo the chunk is sized instead so that a pass takes at most `PASS_SHARE` of
the SLO: the cost model's prefill time, calibrated by this instance's own passes (their compute
time, not the wait for the turn), picks the largest chunk that fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mooncake_server.cost_model.calibration import DEFAULT_HORIZON_S, SmoothedCalibration
from mooncake_server.cost_model.perf_model import PerfModel

# The rest of the SLO is the decode's own step (and the time its batch waits to be sent).
PASS_SHARE = 0.5
# Smaller chunks re-read every weight for a few tokens each; below this a prompt crawls.
MIN_CHUNK = 16


class ChunkBudget:
    """The prompt-token chunk of a pass beside decoding: --decode-chunk, or what fits the SLO."""

    def __init__(self, cap: int, model: PerfModel | None = None,
                 tbt_slo_s: float | None = None, *, horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.model = model if tbt_slo_s is not None else None
        self.budget_s = (tbt_slo_s or 0.0) * PASS_SHARE
        # NOTE: clamped wider than the conductor's (0.25..8): a machine several times slower
        # than the built-in profile must still get chunks that fit.
        self._calibration = SmoothedCalibration(lo=0.05, hi=50.0, horizon_s=horizon_s,
                                                clock=clock)

    def observe(self, tokens: int, cached_tokens: int, compute_s: float) -> None:
        """A pass computed `tokens` prompt tokens after `cached_tokens` in `compute_s` seconds."""
        if self.model is not None and tokens > 0:
            self._calibration.add(compute_s, self.model.prefill_s(tokens, cached_tokens))

    def tokens(self) -> int:
        """Prompt tokens the next pass may carry while a decode waits for the cores."""
        if self.model is None:
            return self.cap
        cal = self._calibration.value
        lo, hi = MIN_CHUNK, self.cap
        if self.model.prefill_s(lo) * cal >= self.budget_s:
            return min(lo, hi)
        while lo < hi:  # the largest chunk whose calibrated pass fits the budget
            mid = (lo + hi + 1) // 2
            if self.model.prefill_s(mid) * cal <= self.budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
