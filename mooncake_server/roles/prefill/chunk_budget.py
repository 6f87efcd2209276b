"""How many prompt tokens a prefill pass may carry while a decode on the same cores has work.

On one machine a decode's token gap is its own step plus the prefill pass it waited behind (the
processes take turns on the cores, engine/core_budget.py). With --decode-chunk alone (256
tokens: ~0.25 s on the 2-core AMX machine here) every gap that straddled a pass broke a 200 ms
TBT SLO, and a request's TBT is the mean of its longest tenth of gaps, so a few such gaps are
enough. With --tbt-slo the chunk is sized instead so that the decode's step and one pass fit the
SLO (cost_model/passes.py; the decode posts its step on the core board): the cost model's prefill
time, calibrated by this instance's own passes (their compute time, not the wait for the turn),
picks the largest chunk that fits.

What it measured is also what the conductor needs to predict a prompt's TTFT under such cuts
(`split`): a prompt beside a busy decode is computed in passes of `tokens()`, each at the
calibrated model's time, and each pass first waits for a decode step to hand the cores back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from mooncake_server.cost_model.calibration import (
    DEFAULT_HORIZON_S,
    TailMeanCalibration,
    TailSeconds,
)
from mooncake_server.cost_model.passes import (
    MIN_CHUNK,
    SPEED_HORIZON_S,
    chunk_fitting,
    pass_budget_s,
)
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.wire.instances import PassSplit


class ChunkBudget:
    """The prompt-token chunk of a pass beside decoding: --decode-chunk, or what fits the SLO."""

    def __init__(self, cap: int, model: PerfModel | None = None,
                 tbt_slo_s: float | None = None, *, block_tokens: int = 1,
                 horizon_s: float = DEFAULT_HORIZON_S, speed_horizon_s: float = SPEED_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.block_tokens = block_tokens
        self.model = model if tbt_slo_s is not None else None
        self.tbt_slo_s = tbt_slo_s or 0.0

        # NOTE: clamped wider than the conductor's (0.25..8): a machine several times slower
        # than the built-in profile must still get chunks that fit. Not a moving average from
        # 1.0: a few samples must already count in full.
        # Each speed is read two ways: the mean of the slower half (`value`) sizes a pass,
        # which must fit the TBT budget; the `weighted_mean` goes into the conductor's TTFT
        # estimate, which sums passes (a sum's expected value is the sum of the means). Summed
        # over a prompt's passes and the jobs queued ahead, the slower halves put TTFTs at
        # 1.36-1.41x what they measured (median; replays at time scale 4 on `--role all`),
        # and turned away prompts that would have met the SLO.
        def speed() -> TailMeanCalibration:
            return TailMeanCalibration(quantile=0.5, window=64, lo=0.05, hi=50.0,
                                       horizon_s=speed_horizon_s, clock=clock)

        self._calibration = speed()
        # (measured at, tokens) of recent full passes: how long the passes behind the ratio were.
        self._full_sizes: deque[tuple[float, int]] = deque(maxlen=64)
        self._speed_horizon_s = speed_horizon_s
        self._clock = clock
        # Cut passes apart: a few dozen tokens each, they weigh the model's per-pass cost much
        # more than full passes do, and a profile from another machine gets that share wrong
        # (the built-in one on the AMD machine: full passes 2.2x its times, cut ones 1.5x).
        self._cut = speed()
        # (measured, modelled) seconds of a full pass timed at start-up (`seed`): what the
        # speed is read from while no pass is recent, and a prior that never ages beside them.
        self._seed: tuple[float, float] | None = None
        self._seed_tokens = 0
        # Measured / modelled of the last full pass: the machine's speed right now, which the
        # rest of a long pass runs at (`rest_s`).
        self._last_full: float | None = None
        # A prompt's TTFT sums the waits of all its passes, so their mean matters, not one
        # pass's worst. They follow the decode's load: the short horizon.
        self._waits = TailSeconds(horizon_s=horizon_s, clock=clock)

    def observe(self, items: Sequence[tuple[int, int]], compute_s: float, wait_s: float = 0.0,
                beside_decode: bool = False) -> None:
        """A pass computed prompts' chunks of `(new, cached)` tokens in `compute_s` seconds,
        having waited `wait_s` for the cores (`beside_decode`: a decode had work meanwhile).

        Timed against the model's time of the same prompts side by side (`PerfModel.pass_s`),
        as the conductor estimates them: against one prompt of all the pass's tokens, a burst's
        pass was charged attention over 1,692 tokens where its longest prompt had 583, and
        the speed read 10% fast (its next pass: estimated 4.01 s, measured 5.15 s).
        """
        tokens = sum(n for n, _ in items)
        if self.model is not None and tokens > 0:
            modelled = self.model.pass_s(items)
            if beside_decode:
                # NOTE: a cut pass shorter than the least chunk times the per-pass overhead, not
                # the speed a chunk runs at: a burst's 1- and 3-token prompts beside a decode ran
                # at about 0.4x the built-in model, the 81-token chunks sized by that speed right
                # after at 1.13x (167 ms each, against 150 ms less the decode's step), and seven
                # decoding requests missed a 200 ms TBT (204-436 ms). Their wait for the cores is
                # still a wait.
                if tokens >= MIN_CHUNK:
                    self._cut.add(compute_s, modelled)
                self._waits.add_seconds(wait_s)
            else:
                self._calibration.add(compute_s, modelled)
                self._full_sizes.append((self._clock(), tokens))
                self._last_full = compute_s / modelled

    def seed(self, tokens: int, seconds: float) -> None:
        """A full pass of `tokens` prompt tokens took `seconds` at start-up.

        Without it the first prompts' speed is read from whatever ran first: a warm-up's 16-
        and 128-token passes read this machine at 1.1x the built-in model where a burst's
        1,690-token pass ran at 1.4x (goodput replay, x4: estimated 1.88 s, measured 2.55 s).
        The per-pass cost is a larger share of a short pass, so its ratio says little of a
        long one's.
        """
        if self.model is not None and tokens > 0 and seconds > 0:
            self._seed = (seconds, self.model.prefill_s(tokens))
            self._seed_tokens = tokens

    def rest_s(self, items: Sequence[tuple[int, int]]) -> float | None:
        """Seconds a full pass over `(new, cached)` prompt tokens takes at the speed the last
        full pass ran (None: no cost model, or no full pass timed yet)."""
        if self.model is None or self._last_full is None:
            return None
        return self.model.pass_s(items) * self._last_full

    def prompt_s(self, new_tokens: int, beside_decode: bool,
                 decode_step_s: float = 0.0) -> float | None:
        """Seconds a prompt of `new_tokens` started now takes at the speed passes here ran
        lately: in cut passes and their waits while a decode has work (`beside_decode`), else
        whole at the last full pass's speed (`rest_s`). None where that speed was not timed
        here lately (cut) or ever (whole)."""
        if self.model is None or new_tokens <= 0:
            return None
        if not beside_decode:
            return self.rest_s([(new_tokens, 0)])
        if not self._cut.recent:
            return None
        modelled, passes = self.model.chunked_prefill_s(new_tokens, 0, self.tokens(decode_step_s))
        return modelled * self._cut.weighted_mean + passes * self._waits.mean

    def measured_tokens(self) -> int:
        """The largest full pass behind the speed reported: timed within the speed horizon, or
        the start-up pass, which never ages (0: none)."""
        cutoff = self._clock() - self._speed_horizon_s
        recent = max((n for at, n in self._full_sizes if at > cutoff), default=0)
        return max(self._seed_tokens, recent)

    def _ratio(self, cut: bool, mean: bool = False) -> float:
        """Measured / modelled time of full (or cut) passes, the slower half's or (`mean`) all
        of them; the other kind's if none is recent."""
        first, other = (self._cut, self._calibration) if cut else (self._calibration, self._cut)
        chosen = first if first.recent or not other.recent else other
        if self._seed is not None:
            if not chosen.recent:
                return self._calibration.weighted_mean_with(*self._seed)
            if mean and chosen is self._calibration:
                return chosen.weighted_mean_with(*self._seed)
        return chosen.weighted_mean if mean else chosen.value

    def split(self, shared: bool, idle_chunk: int, decode_step_s: float = 0.0) -> PassSplit | None:
        """How a prompt's passes go, for the conductor's TTFT estimate (None without
        --tbt-slo). `idle_chunk`: the chunk while no decode on these cores (`shared`) has work."""
        if self.model is None:
            return None
        return PassSplit(chunk_tokens=idle_chunk,
                         cut_tokens=min(idle_chunk, self.tokens(decode_step_s)),
                         ratio=self._ratio(cut=False, mean=True),
                         cut_ratio=self._ratio(cut=True, mean=True),
                         wait_s=self._waits.mean, shared=shared,
                         measured_tokens=self.measured_tokens(),
                         cut_timed=bool(self._cut.recent))

    def tokens(self, decode_step_s: float = 0.0) -> int:
        """Prompt tokens the next pass may carry while a decode whose steps take
        `decode_step_s` waits for the cores."""
        if self.model is None:
            return self.cap
        budget = pass_budget_s(self.tbt_slo_s, decode_step_s)
        chunk = chunk_fitting(self.model, self._ratio(cut=True), budget, self.cap)
        # Whole blocks: the worker cuts prompts on block boundaries (kv_cache.prompt_cut), and
        # the conductor estimates cut passes of this many tokens (PassSplit.cut_tokens).
        return max(self.block_tokens, chunk // self.block_tokens * self.block_tokens)
