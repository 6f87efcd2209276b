"""What each placed request was estimated against what it got, as this conductor saw its tokens.

One log line per request when it ends (estimated and measured TTFT and TBT) and counters of the
requests within both SLOs or over one: an estimate under the SLO with a measurement over it is a
misjudged admission, both over it an overload, and only the two side by side tell them apart.
TBT is the paper's (and the replay scripts'): the mean of the request's longest tenth of gaps
between tokens the decode made; the gap before the second token is the hand-off from prefill to
decode (KV load, joining the batch), judged as time to the second token against TTFT + TBT.
TTFT is from placement to the first token, so it leaves out the HTTP and tokenizer time a
client also sees. Measured / estimated TTFT and TBT of every request are kept (`ratios`) for
/metrics: a scheduler that promises what it then misses shows there before its clients see it.
How far the long TTFT estimates ran over lately (`overrun`) sets how much of the SLO a burst's
first pass may take (bursts.first_pass_share).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WITHIN = "within"
TTFT_MISSED = "ttft_missed"
SECOND_MISSED = "second_token_missed"  # the hand-off made the second token later than TTFT + TBT
TBT_MISSED = "tbt_missed"
VERDICTS = (WITHIN, TTFT_MISSED, SECOND_MISSED, TBT_MISSED)
# Measured / estimated ratios kept for /metrics' quantiles.
RECENT_RATIOS = 1024
# NOTE: a TTFT estimate is long when it takes this share of the TTFT SLO or more: under it the
# per-pass constants and the hand-off's jitter weigh more than the host's speed (a burst's
# 0.9 s pass estimated at 1.11 s read 0.81x), and over it a miss is near.
LONG_ESTIMATE_SLO_SHARE = 0.5
# How long a long estimate's overrun counts. The host's speed drifts over minutes (a 2,048-token
# forward: 3.61 s, and 12 s later 4.19 s); a benchmark's bursts at the lightest rate are 48 s
# apart, so this spans several of them.
OVERRUN_HORIZON_S = 300.0


def longest_tenth(gaps: int) -> int:
    """How many of a request's `gaps` token gaps its TBT averages: a tenth, rounded up, at
    least one."""
    return max(1, math.ceil(0.1 * gaps))


def longest_tenth_mean(gaps: Sequence[float]) -> float | None:
    """Mean of the longest 10% of token gaps (at least one); None without a gap."""
    if not gaps:
        return None
    k = longest_tenth(len(gaps))
    return sum(sorted(gaps, reverse=True)[:k]) / k


@dataclass
class _Timing:
    placed_at: float
    ttft_estimate_s: float
    tbt_estimate_s: float
    first_at: float | None = None
    second_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)  # after the second token


class RequestOutcomes:
    """Timings of the requests in flight; each one's verdict against the SLOs when it ends."""

    def __init__(self, ttft_slo_s: float | None = None, tbt_slo_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self._clock = clock
        self._timings: dict[str, _Timing] = {}
        self.counts: Counter[str] = Counter()  # VERDICTS
        # measured / estimated, per finished request: "ttft", "tbt"
        self.ratios: dict[str, deque[float]] = {k: deque(maxlen=RECENT_RATIOS)
                                                for k in ("ttft", "tbt")}
        # (ended at, measured / estimated TTFT) of the requests with a long estimate.
        self._long: deque[tuple[float, float]] = deque(maxlen=RECENT_RATIOS)

    def placed(self, request_id: str, ttft_estimate_s: float, tbt_estimate_s: float) -> None:
        """The scheduler placed the request with these estimates."""
        self._timings[request_id] = _Timing(self._clock(), ttft_estimate_s, tbt_estimate_s)

    def first_token(self, request_id: str) -> None:
        """The request's first token arrived (its prefill finished)."""
        t = self._timings.get(request_id)
        if t is not None and t.first_at is None:
            t.first_at = t.last_at = self._clock()

    def token(self, request_id: str) -> None:
        """One more token arrived."""
        t = self._timings.get(request_id)
        if t is None or t.last_at is None:
            return
        now = self._clock()
        if t.second_at is None:
            t.second_at = now
        else:
            t.gaps.append(now - t.last_at)
        t.last_at = now

    def finished(self, request_id: str) -> str | None:
        """The request ended: log it and count its verdict (None if it never got a token)."""
        t = self._timings.pop(request_id, None)
        if t is None or t.first_at is None:
            return None
        ttft = t.first_at - t.placed_at
        second = None if t.second_at is None else t.second_at - t.placed_at
        tbt = longest_tenth_mean(t.gaps)
        verdict = self._verdict(ttft, second, tbt)
        self.counts[verdict] += 1
        for key, measured, estimated in (("ttft", ttft, t.ttft_estimate_s),
                                         ("tbt", tbt, t.tbt_estimate_s)):
            if measured is not None and estimated > 0:
                self.ratios[key].append(measured / estimated)
        if (self.ttft_slo_s is not None and t.ttft_estimate_s > 0
                and t.ttft_estimate_s >= LONG_ESTIMATE_SLO_SHARE * self.ttft_slo_s):
            self._long.append((self._clock(), ttft / t.ttft_estimate_s))
        measured_tbt = f"{tbt * 1000:.0f} ms" if tbt is not None else "-"
        measured_second = f"{second:.2f} s" if second is not None else "-"
        log.info("finished %s (%d tokens): TTFT %.2f s (estimated %.2f), second token %s, TBT %s "
                 "(estimated %.0f ms): %s", request_id, len(t.gaps) + 1 + (second is not None),
                 ttft, t.ttft_estimate_s, measured_second, measured_tbt,
                 t.tbt_estimate_s * 1000, verdict)
        return verdict

    def overrun(self) -> float | None:
        """The most a long TTFT estimate (half the SLO or more) ran over lately, measured /
        estimated; None when none ended within `OVERRUN_HORIZON_S`."""
        cutoff = self._clock() - OVERRUN_HORIZON_S
        recent = [ratio for at, ratio in self._long if at > cutoff]
        return max(recent) if recent else None

    def _verdict(self, ttft: float, second: float | None, tbt: float | None) -> str:
        if self.ttft_slo_s is not None and ttft > self.ttft_slo_s:
            return TTFT_MISSED
        if (self.ttft_slo_s is not None and self.tbt_slo_s is not None and second is not None
                and second > self.ttft_slo_s + self.tbt_slo_s):
            return SECOND_MISSED
        if self.tbt_slo_s is not None and tbt is not None and tbt > self.tbt_slo_s:
            return TBT_MISSED
        return WITHIN
