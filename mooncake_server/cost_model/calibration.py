"""Calibration of modelled times by measured ones, kept only while the measurements are recent.

A request's TBT is the mean of its longest 10% of token gaps (the paper's definition), so a mean
correction under-predicts what the SLO sees whenever steps vary (a prefill sharing the CPU, a
long batch). `TailCalibration` keeps the recent measured / modelled ratios and answers a high
quantile of them, `TailMeanCalibration` the mean of their longest tenth (as TBT is judged), so
admission and the scheduler's TBT estimates budget for the slow steps.
`SmoothedCalibration` is the prefill side's moving average of the same ratio.
`GapTailCalibration` is a decode's token gap taken whole: a step (a ratio to its modelled time)
plus its wait for the cores, whose slow tail is the tail of the sum.

Both forget by time as well as by count: a ratio older than `horizon_s` is dropped when the
value is read. Only admitted work produces measurements, so a calibration that aged by count
alone would keep an overload's slow steps forever once they made admission refuse everything;
with the horizon, an idle instance is back on its modelled (uncalibrated) times after
`horizon_s` seconds; a decode's gaps go back to its quiet step as measured at start-up
(`GapTailCalibration.seed_quiet`), not to the built-in model's guess.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# NOTE: long enough to hold a useful tail under load: token gaps arrive tens per second, so
# the 256-sample window fills well inside it, and at a few requests per second the hand-off tail
# (one sample per request) still sees tens of samples. Short enough that a client honouring
# Retry-After (1 s) gets through about ten seconds after an overload ends, not never.
DEFAULT_HORIZON_S = 10.0
# NOTE: the lowest measured / modelled step ratio kept. The built-in model is one machine's fp32
# steps; int8 / bf16 steps here ran at a third of it, which a floor of 0.5 read as half (and a
# short answer's hand-off budget with it).
RATIO_FLOOR = 0.1


class _Recent:
    """Clamped ratios with the time each was measured (and a second value measured with each,
    0.0 unless given), at most `window` of them."""

    def __init__(self, window: int, lo: float, hi: float, horizon_s: float,
                 clock: Callable[[], float]) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s}")
        self.lo, self.hi = lo, hi
        self.horizon_s = horizon_s
        self._clock = clock
        # (measured at, ratio, extra)
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.changed = False  # since the owner last computed its value

    def add(self, measured_s: float, modelled_s: float, at: float | None = None,
            extra: float = 0.0) -> None:
        """Keep measured / modelled, clamped, and `extra`, stamped `at` (default now; nothing if
        nothing was modelled). Stamps must not go back in time."""
        if modelled_s <= 0:
            return
        ratio = self.clamp(measured_s / modelled_s)
        self.samples.append((self._clock() if at is None else at, ratio, extra))
        self.changed = True

    def clamp(self, ratio: float) -> float:
        """`ratio` within the bounds every kept ratio is held to."""
        return min(self.hi, max(self.lo, ratio))

    def expire(self) -> None:
        """Drop the samples older than the horizon."""
        # Appended in clock order, so the oldest are at the left.
        cutoff = self._clock() - self.horizon_s
        while self.samples and self.samples[0][0] <= cutoff:
            self.samples.popleft()
            self.changed = True


class _RecentCalibration:
    """A summary of the recent ratios, recomputed on read only when they changed."""

    empty = 1.0  # the value with nothing recent: the model's own times

    def __init__(self, window: int, lo: float, hi: float, horizon_s: float,
                 clock: Callable[[], float]) -> None:
        self._recent = _Recent(window, lo, hi, horizon_s, clock)
        self._value = self.empty

    def add(self, measured_s: float, modelled_s: float, at: float | None = None) -> None:
        """One measured step, gap or job against what the model predicted for it."""
        self._recent.add(measured_s, modelled_s, at, extra=modelled_s)

    @property
    def value(self) -> float:
        """The factor to multiply modelled times by (1.0 when nothing is recent)."""
        recent = self._recent
        recent.expire()
        if recent.changed:
            # Summarised on read, not per sample: samples arrive per token, reads per request.
            ratios = [ratio for _, ratio, _ in recent.samples]
            self._value = self._summarise(ratios) if ratios else self.empty
            recent.changed = False
        return self._value

    @property
    def mean(self) -> float:
        """The plain mean of the same recent ratios (`empty` when none is recent): what a sum of
        many measured things is expected to take, where `value` budgets for one of them."""
        self._recent.expire()
        samples = self._recent.samples
        return sum(r for _, r, _ in samples) / len(samples) if samples else self.empty

    @property
    def weighted_mean(self) -> float:
        """Measured / modelled over the recent samples taken together: each weighs by its
        modelled time (`empty` when none is recent). What a sum of passes like them takes, where
        the plain mean weighs a 1-token pass like a 2-second one: with it, a goodput replay's
        TTFTs came at 1.53x their estimates (p50, x4); taken together, 1.10x."""
        self._recent.expire()
        weight = sum(m for _, _, m in self._recent.samples)
        if weight <= 0:
            return self.empty
        return sum(r * m for _, r, m in self._recent.samples) / weight

    def weighted_mean_with(self, measured_s: float, modelled_s: float) -> float:
        """`weighted_mean` with one more measurement that never ages (a start-up seed)."""
        if modelled_s <= 0:
            return self.weighted_mean
        self._recent.expire()
        samples = self._recent.samples
        weight = modelled_s + sum(m for _, _, m in samples)
        seeded = self._recent.clamp(measured_s / modelled_s) * modelled_s
        return (seeded + sum(r * m for _, r, m in samples)) / weight

    @property
    def recent(self) -> int:
        """How many measurements are recent (0: `value` is the model's own)."""
        self._recent.expire()
        return len(self._recent.samples)

    def _summarise(self, ratios: list[float]) -> float:
        raise NotImplementedError


class TailCalibration(_RecentCalibration):
    """A high quantile of recent measured / modelled ratios (1.0 when none is recent)."""

    def __init__(self, *, quantile: float = 0.9, window: int = 256, lo: float = RATIO_FLOOR,
                 hi: float = 30.0, horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        super().__init__(window, lo, hi, horizon_s, clock)
        self.quantile = quantile

    def _summarise(self, ratios: list[float]) -> float:
        ordered = sorted(ratios)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]


class TailMeanCalibration(TailCalibration):
    """The mean of the recent ratios from the quantile up (1.0 when none is recent).

    A request's TBT is the mean of its longest tenth of gaps, so the mean of the recent gaps'
    longest tenth is what a request like them is judged by. Their 90th percentile, the tail's
    lowest value, under-read it whenever the tail was long: prefill passes and other processes
    on the cores stretch a few gaps a lot, not many gaps a little.
    """

    def _summarise(self, ratios: list[float]) -> float:
        ordered = sorted(ratios)
        tail = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered))):]
        return sum(tail) / len(tail)


class TailSeconds(TailCalibration):
    """A high quantile of a recent duration, in seconds (0.0 when none is recent).

    For what a token gap holds that does not scale with the batch: the wait for the cores while
    a prefill pass beside the decode runs, a request's hand-off from prefill to decode. Read as
    a ratio of the step, it would read as a slow step, and a batch ten times larger would be
    predicted to wait ten times longer.
    """

    empty = 0.0

    def __init__(self, *, quantile: float = 0.9, window: int = 256, hi: float = 30.0,
                 horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(quantile=quantile, window=window, lo=0.0, hi=hi, horizon_s=horizon_s,
                         clock=clock)

    def add_seconds(self, seconds: float, at: float | None = None) -> None:
        """One measured duration."""
        self.add(seconds, 1.0, at)


class SmoothedCalibration(_RecentCalibration):
    """An exponential moving average of recent measured / modelled ratios, starting at 1.0."""

    # NOTE: the seed's weight after 64 samples is (1 - alpha)^64, about 1e-10 at alpha 0.3: the
    # window changes nothing against an unbounded average while every sample is recent.
    def __init__(self, *, alpha: float = 0.3, window: int = 64, lo: float = 0.25,
                 hi: float = 8.0, horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        super().__init__(window, lo, hi, horizon_s, clock)
        self.alpha = alpha

    def _summarise(self, ratios: list[float]) -> float:
        value = 1.0
        for ratio in ratios:
            value += self.alpha * (ratio - value)
        return value


class GapTailCalibration:
    """The slow tail of recent token gaps, each a step (measured / modelled) plus a wait for the
    cores (seconds) before it: the mean of the longest tenth of `ratio x step + wait`.

    Taken apart, the tail of the ratios plus the tail of the waits counts the slowest step and
    the longest wait as if they came together, and they rarely do: a wait is a prefill pass
    beside the decode, a slow step another process on the cores. In replays of the paper's
    trace on `--role all`, tails taken apart estimated long answers' TBT at 1.08x what they
    measured (median over a run), the tail of the sum at 1.00-1.01x.
    """

    def __init__(self, *, quantile: float = 0.9, window: int = 256, lo: float = RATIO_FLOOR,
                 hi: float = 30.0, horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self._recent = _Recent(window, lo, hi, horizon_s, clock)
        self.quiet_ratio = 1.0  # measured / modelled of a step alone on the cores

    def seed_quiet(self, measured_s: float, modelled_s: float) -> None:
        """A step timed alone (start-up): the ratio gaps go back to once nothing is recent.

        The built-in model is one machine's fp32 numbers; on this one int8 / bf16 steps ran at a
        third of it, and an idle instance's first requests, judged on the bare model, were
        refused ("estimated TBT 210 ms") where they decoded in 30-50 ms gaps.
        """
        if modelled_s > 0:
            self.quiet_ratio = self._recent.clamp(measured_s / modelled_s)

    def add(self, measured_s: float, modelled_s: float, wait_s: float = 0.0,
            at: float | None = None) -> None:
        """One step of `measured_s` against the model's `modelled_s`, after `wait_s` waiting."""
        self._recent.add(measured_s, modelled_s, at, extra=max(0.0, wait_s))

    @property
    def recent(self) -> int:
        """How many gaps are recent (0: the model's own step, no wait)."""
        self._recent.expire()
        return len(self._recent.samples)

    def split(self, modelled_s: float) -> tuple[float, float]:
        """(ratio, wait): the means over the recent gaps that are the longest tenth for a step
        modelled at `modelled_s`; (quiet ratio, 0.0) when none is recent. `ratio x step + wait`
        is then their tail mean at that step, and close to it for a batch one larger or smaller."""
        self._recent.expire()
        samples = self._recent.samples
        if not samples:
            return self.quiet_ratio, 0.0
        ordered = sorted(samples, key=lambda s: s[1] * modelled_s + s[2])
        tail = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered))):]
        return (sum(s[1] for s in tail) / len(tail), sum(s[2] for s in tail) / len(tail))

    def mean_ratio(self) -> float:
        """Measured / modelled over all the recent steps (the quiet ratio when none is): what
        a sum of many steps runs at, where one gap is judged by the tail."""
        self._recent.expire()
        samples = self._recent.samples
        if not samples:
            return self.quiet_ratio
        return sum(s[1] for s in samples) / len(samples)

    def predict(self, modelled_s: float) -> float:
        """The slow tail of a gap whose step the model puts at `modelled_s`."""
        ratio, wait = self.split(modelled_s)
        return ratio * modelled_s + wait
