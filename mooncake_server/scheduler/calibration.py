"""Calibration of modelled step times by measured ones, at the tail the TBT SLO is judged on.

A request's TBT is the mean of its longest 10% of token gaps (the paper's definition), so a mean
correction under-predicts what the SLO sees whenever steps vary (a prefill sharing the CPU, a
long batch). `TailCalibration` keeps the recent measured / modelled ratios and answers their
90th percentile, so admission and the scheduler's TBT estimates budget for the slow steps.
"""

from __future__ import annotations

from collections import deque


class TailCalibration:
    """A high quantile of recent measured / modelled ratios (1.0 until something is measured)."""

    def __init__(self, *, quantile: float = 0.9, window: int = 256, lo: float = 0.5,
                 hi: float = 30.0) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.lo, self.hi = lo, hi
        self._ratios: deque[float] = deque(maxlen=window)
        self._value = 1.0

    def add(self, measured_s: float, modelled_s: float) -> None:
        """One measured step (or gap) against what the model predicted for it."""
        if modelled_s <= 0:
            return
        self._ratios.append(min(self.hi, max(self.lo, measured_s / modelled_s)))
        ordered = sorted(self._ratios)
        self._value = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    @property
    def value(self) -> float:
        """The factor to multiply modelled step times by."""
        return self._value
