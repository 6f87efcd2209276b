"""SLO admission of `--role colocated`: the conductor's rules, over one engine's own passes.

With `--ttft-slo` / `--tbt-slo`, requests that arrive together are decided together, cheapest
first (`api/burst.py`); each is estimated against the work the engine already holds (the prompt
tokens waiting or part-computed ahead of it: while no row decodes, the next pass computes up to
--prefill-chunk of them at full speed, the rest in passes beside the rows that pass makes) with
the cost model scaled by this engine's own passes, measured apart: one-token passes against the
modelled decode step (their 90th percentile over the last 10 s: TBT is judged on the slow
gaps), and passes with prompt tokens, less their rows' step, against the modelled prefill (over
the last minute: their ratio taken together for TTFTs, the slower half's for sizing a pass; as
one smoothed ratio of both, the first request's pass made an idle engine refuse the second,
"estimated TBT 224 ms"). Until it has measured decode steps it uses the quiet step timed at
start (`seed_quiet_step`); for prompts, a pass timed at start (`seed_prompt_pass`) beside the
recent ones (without it, the decode ratio until three prefill passes are recent). Refused
requests get 429 at once. With `--tbt-slo` a pass beside decoding rows takes the largest prompt
chunk (16-token steps) whose time fits `GAP_SHARE` of the SLO: the pass is the decoding rows'
token gap. An accepted prompt that still has not started computing when its TTFT SLO less its
own compute has passed ends before any work (429, `LATE_FOR_SLO`).
"""

from __future__ import annotations

import logging
import math
import time

from mooncake_server.api.backend import BackendError, GenerateRequest
from mooncake_server.api.burst import BURST_WINDOW_S, BurstGate, Order
from mooncake_server.cost_model.calibration import (
    RATIO_FLOOR,
    TailCalibration,
    TailMeanCalibration,
)
from mooncake_server.cost_model.passes import GAP_SHARE, MIN_CHUNK, SPEED_HORIZON_S
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.engine.loop import EngineLoop
from mooncake_server.engine.sequence import Sequence

log = logging.getLogger(__name__)


class ColocatedAdmission:
    """Decides bursts of requests for one engine loop; submits the accepted ones in order."""

    def __init__(self, loop: EngineLoop, model: PerfModel, *, ttft_slo_s: float | None,
                 tbt_slo_s: float | None, window_s: float = BURST_WINDOW_S) -> None:
        self.loop = loop
        self.model = model
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.decode = TailCalibration(quantile=0.9)
        # Prompt tokens' speed, kept for a minute (bursts come tens of seconds apart; forgotten
        # after 10 s, a burst's passes were sized by the decode's ratio and its rows' gaps
        # measured 430 ms against a 150 ms budget). Their ratio taken together (`weighted_mean`)
        # sums into TTFTs; the slower half's mean (`value`) sizes a pass, which must fit the TBT
        # budget (as roles/prefill/chunk_budget.py).
        self.prefill = TailMeanCalibration(quantile=0.5, horizon_s=SPEED_HORIZON_S)
        self._quiet = 1.0  # measured / modelled quiet step, the fallback of `decode`
        self._seed: tuple[float, float] | None = None  # (measured, modelled) start-up pass
        self.gate: BurstGate[list[Sequence], None] = BurstGate(self._decide, window_s=window_s)
        self.rejected = 0
        loop.pass_observer = self.observed
        if tbt_slo_s is not None:
            loop.chunk_budget = self.chunk_for

    async def admit(self, request: GenerateRequest, seqs: list[Sequence]) -> None:
        """Submit the request's sequences in its burst's order, or raise 429."""
        await self.gate.admit(seqs, len(request.prompt_token_ids))

    def seed_quiet_step(self, batch: int, context: int, seconds: float) -> None:
        """The quiet step timed at start-up: the decode ratio while no step is recent."""
        modelled = self.model.decode_step_s(batch, context)
        if modelled > 0:
            self._quiet = max(RATIO_FLOOR, seconds / modelled)

    def seed_prompt_pass(self, tokens: int, seconds: float) -> None:
        """A full pass of a `tokens`-token prompt timed at start-up: the prompt speed while
        fewer than three passes are recent, and a prior beside them (weighed by its modelled
        time) that never ages. Read from the decode's ratio instead, an idle engine's first
        burst was estimated at 0.38x the model where its prompts ran at 1.4x (a 1,692-token
        pass: 0.84 s estimated, 3.27 s measured)."""
        if tokens > 0 and seconds > 0:
            self._seed = (seconds, self.model.prefill_s(tokens))

    def observed(self, prompt_tokens: int, rows: int, context: int, seconds: float) -> None:
        """A pass ran: its time calibrates the model's decode steps or prefill."""
        step = self.model.decode_step_s(rows, context)
        if not prompt_tokens:
            self.decode.add(seconds, step)
            return
        rest = max(0.0, seconds - self.decode_ratio * step)
        self.prefill.add(rest, self.model.prefill_s(prompt_tokens))

    @property
    def decode_ratio(self) -> float:
        """Measured / modelled decode steps (the quiet step's while none is recent)."""
        return self.decode.value if self.decode.recent else self._quiet

    @property
    def prefill_ratio(self) -> float:
        """Measured / modelled prefill (the decode ratio until three passes are recent)."""
        if self._seed is not None:
            return self.prefill.weighted_mean_with(*self._seed)
        return self.prefill.weighted_mean if self.prefill.recent >= 3 else self.decode_ratio

    def _modelled(self, prompt_tokens: int, rows: int, context: int, *,
                  slow: bool = False) -> float:
        """A pass's time: its prompt tokens and its decoding rows, each by its own ratio
        (`slow`: the prompt tokens at the slower half's speed)."""
        prefill = (self.prefill.value if slow and self.prefill.recent >= 3
                   else self.prefill_ratio)
        return (prefill * self.model.prefill_s(prompt_tokens)
                + self.decode_ratio * self.model.decode_step_s(rows, context))

    def chunk_for(self, rows: int, context: int) -> int:
        """The largest prompt chunk (a multiple of 16, at least 16) whose pass beside `rows`
        decoding rows is estimated within `GAP_SHARE` of the TBT SLO: the pass is those rows'
        token gap, and the loop's own work between passes (sampling, streaming) takes the rest
        (sized to the whole SLO, gaps ran past it)."""
        assert self.tbt_slo_s is not None
        budget = GAP_SHARE * self.tbt_slo_s
        chunk = MIN_CHUNK
        while (chunk + MIN_CHUNK <= self.loop.decode_chunk_tokens
               and self._modelled(chunk + MIN_CHUNK, rows, context, slow=True) <= budget):
            chunk += MIN_CHUNK
        return chunk

    def _cut_passes_s(self, tokens: int, rows: int, context: int) -> float:
        """Seconds to compute `tokens` prompt tokens in passes beside `rows` decoding rows."""
        if tokens <= 0:
            return 0.0
        chunk = (self.chunk_for(rows, context) if self.tbt_slo_s is not None
                 else self.loop.decode_chunk_tokens)
        full, rest = divmod(tokens, chunk)
        return full * self._modelled(chunk, rows, context) + (
            self._modelled(rest, rows, context) if rest else 0.0)

    def estimate(self, prompt_tokens: int) -> tuple[float, float, float]:
        """(TTFT, TBT, own compute) seconds of a prompt admitted now, after the work held.

        While no row decodes, the next pass computes prompts at full speed (up to
        --prefill-chunk tokens); whatever is left runs beside the rows that pass made, in cut
        passes. Estimated as if at full speed, a burst's 1,518-token prompt was admitted at
        1.25 s and its rows' gaps at 48 ms.
        """
        loop = self.loop
        rows = [s for s in loop.running if s.decoding]
        ahead = [s for s in loop.running if not s.decoding] + list(loop.waiting)
        context = sum(s.num_computed + 1 for s in rows)
        before = sum(s.num_pending for s in ahead)
        full = 0 if rows else min(before + prompt_tokens, loop.prefill_chunk_tokens)
        # Beside the cut passes decode the rows now and the prompts ahead, once computed.
        batch = len(rows) + len(ahead)
        after = context + sum(len(s.token_ids) for s in ahead)
        ttft = (self.prefill_ratio * self.model.prefill_s(full)
                + self._cut_passes_s(before + prompt_tokens - full, batch, after))
        own_full = max(0, min(prompt_tokens, full - before))
        own = (self.prefill_ratio * self.model.prefill_s(own_full)
               + self._cut_passes_s(prompt_tokens - own_full, batch, after))
        tbt = self._modelled(0, batch + 1, after + prompt_tokens)
        if self.tbt_slo_s is not None:
            # Prompts that come while it decodes run in passes beside its row, each sized to
            # GAP_SHARE of the SLO, or the least chunk if even that does not fit.
            tbt = max(tbt, GAP_SHARE * self.tbt_slo_s,
                      self._modelled(MIN_CHUNK, batch + 1, after + prompt_tokens))
        return ttft, tbt, own

    def _decide(self, seqs: list[Sequence], order: Order) -> None:
        lead = seqs[0]
        ttft, tbt, own = self.estimate(len(lead.token_ids))
        problems = []
        if self.ttft_slo_s is not None and ttft > self.ttft_slo_s:
            problems.append(f"estimated TTFT {ttft:.2f} s exceeds the {self.ttft_slo_s:g} s SLO "
                            "(--ttft-slo)")
        if self.tbt_slo_s is not None and tbt > self.tbt_slo_s:
            problems.append(f"estimated TBT {tbt * 1000:.0f} ms exceeds the "
                            f"{self.tbt_slo_s * 1000:g} ms SLO (--tbt-slo)")
        if problems:
            self.rejected += 1
            retry = min(60.0, max(1.0, math.ceil(ttft - (self.ttft_slo_s or ttft))))
            log.info("rejecting %s (%d prompt tokens): %s", lead.request_id,
                     len(lead.token_ids), "; ".join(problems))
            raise BackendError(f"server overloaded: {'; '.join(problems)}; retry in {retry:g} s",
                               429, code="slo_unattainable", retry_after_s=retry)
        if self.ttft_slo_s is not None:
            lead.start_by = time.perf_counter() + self.ttft_slo_s - own
        log.info("admitting %s (%d prompt tokens, rank %d): estimated TTFT %.2f s, TBT %.0f ms",
                 lead.request_id, len(lead.token_ids), order.rank, ttft, tbt * 1000)
        self.loop.submit(lead)

