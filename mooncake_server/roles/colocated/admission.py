"""SLO admission of `--role colocated`: the conductor's rules, over one engine's own passes.

With `--ttft-slo` / `--tbt-slo`, requests that arrive together are decided together, cheapest
first (`api/burst.py`); each is estimated against the work the engine already holds (the prompt
tokens waiting or part-computed ahead of it, computed in passes beside the decoding rows) with
the cost model scaled by this engine's own passes (measured / modelled, smoothed over the last
10 s). Refused requests get 429 at once. With `--tbt-slo` a pass beside decoding rows takes the
largest prompt chunk (16-token steps) whose modelled time, so scaled, fits the SLO: the chunk
is the decoding rows' token gap. An accepted prompt that still has not started computing when
its TTFT SLO less its own compute has passed ends before any work (429, `LATE_FOR_SLO`).
"""

from __future__ import annotations

import logging
import math
import time

from mooncake_server.api.backend import BackendError, GenerateRequest
from mooncake_server.api.burst import BURST_WINDOW_S, BurstGate, Order
from mooncake_server.cost_model.calibration import RATIO_FLOOR, SmoothedCalibration
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.engine.loop import EngineLoop
from mooncake_server.engine.sequence import Sequence

log = logging.getLogger(__name__)

MIN_CHUNK = 16  # the smallest prompt chunk a pass beside decoding rows takes


class ColocatedAdmission:
    """Decides bursts of requests for one engine loop; submits the accepted ones in order."""

    def __init__(self, loop: EngineLoop, model: PerfModel, *, ttft_slo_s: float | None,
                 tbt_slo_s: float | None, window_s: float = BURST_WINDOW_S) -> None:
        self.loop = loop
        self.model = model
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.ratio = SmoothedCalibration(lo=RATIO_FLOOR)
        self.gate: BurstGate[list[Sequence], None] = BurstGate(self._decide, window_s=window_s)
        self.rejected = 0
        loop.pass_observer = self.observed
        if tbt_slo_s is not None:
            loop.chunk_budget = self.chunk_for

    async def admit(self, request: GenerateRequest, seqs: list[Sequence]) -> None:
        """Submit the request's sequences in its burst's order, or raise 429."""
        await self.gate.admit(seqs, len(request.prompt_token_ids))

    def observed(self, prompt_tokens: int, rows: int, context: int, seconds: float) -> None:
        """A pass ran: its time calibrates the model."""
        self.ratio.add(seconds, self._modelled(prompt_tokens, rows, context))

    def _modelled(self, prompt_tokens: int, rows: int, context: int) -> float:
        return self.model.prefill_s(prompt_tokens) + self.model.decode_step_s(rows, context)

    def chunk_for(self, rows: int, context: int) -> int:
        """The largest prompt chunk (a multiple of 16, at least 16) whose pass beside `rows`
        decoding rows is estimated within the TBT SLO."""
        assert self.tbt_slo_s is not None
        budget = self.tbt_slo_s / self.ratio.value
        chunk = MIN_CHUNK
        while (chunk + MIN_CHUNK <= self.loop.decode_chunk_tokens
               and self._modelled(chunk + MIN_CHUNK, rows, context) <= budget):
            chunk += MIN_CHUNK
        return chunk

    def estimate(self, prompt_tokens: int) -> tuple[float, float, float]:
        """(TTFT, TBT, own compute) seconds of a prompt admitted now, after the work held."""
        r = self.ratio.value
        loop = self.loop
        rows = [s for s in loop.running if s.num_pending == 1]
        ahead = [s for s in loop.running if s.num_pending > 1] + list(loop.waiting)
        context = sum(s.num_computed + 1 for s in rows)
        if rows:
            chunk = (self.chunk_for(len(rows), context) if self.tbt_slo_s is not None
                     else loop.decode_chunk_tokens)
        else:
            chunk = loop.prefill_chunk_tokens
        pending = sum(s.num_pending for s in ahead) + prompt_tokens
        modelled, passes = self.model.chunked_prefill_s(pending, 0, chunk)
        ttft = r * (modelled + passes * self.model.decode_step_s(len(rows), context))
        own, own_passes = self.model.chunked_prefill_s(prompt_tokens, 0, chunk)
        own = r * (own + own_passes * self.model.decode_step_s(len(rows), context))
        # Once it decodes, the rows ahead of it decode too; a pass gives them at least the
        # smallest chunk while prompts remain.
        batch = len(rows) + len(ahead) + 1
        after = context + sum(len(s.token_ids) for s in ahead) + prompt_tokens
        tbt = r * self._modelled(MIN_CHUNK if ahead else 0, batch, after)
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

