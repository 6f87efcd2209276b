"""Decode admission control, the decode instance's half: take a request only while its KV memory
and predicted time between tokens allow.

A request walks: reserved (POST /internal/decode/reserve, before its prefill starts; held for
`ttl_s`) -> claimed by its decode job (held until its stream ends) -> released. A request is
refused (HTTP 503, which the conductor turns into another decode instance or a 429) when
  - KV: the worst-case blocks of every held request (prompt + max_tokens, capped by the context
    window) plus its own exceed the pool: admitted, it could run out of blocks mid-stream;
  - TBT (with --tbt-slo): the token gap predicted for the batch with it exceeds the SLO. A gap
    is the step itself — the cost model (--profile or built-in), calibrated by the steps this
    instance computed in the last `horizon_s` seconds (their slow tail: TBT is judged on the
    longest gaps) — plus the wait for the cores before it (a prefill pass beside it on one
    machine, in seconds: it does not grow with the batch). The tail is taken of each gap's
    step and wait together (calibration.GapTailCalibration).
An idle instance takes any request, so one too large for the SLO alone is still served; and an
instance that ran no steps for `horizon_s` predicts with the model scaled to the quiet step it
timed at start-up again, so an overload's slow steps do not outlive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_server.cost_model.calibration import DEFAULT_HORIZON_S, GapTailCalibration
from mooncake_server.cost_model.perf_model import PerfModel


class AdmissionRefused(Exception):
    """This instance cannot take the request now (the message says why)."""


@dataclass
class _Hold:
    blocks: int  # worst-case KV blocks
    context: int  # prompt tokens it attends
    expires_at: float | None  # reservations expire; claimed requests are held until released
    finished: Callable[[], bool] | None = None  # a claimed request whose stream never ran


class DecodeAdmission:
    """Reservations and claims of one decode instance, checked against its KV pool and TBT."""

    def __init__(self, total_blocks: int, block_tokens: int, max_model_len: int, *,
                 model: PerfModel | None = None, tbt_slo_s: float | None = None,
                 ttl_s: float = 120.0, horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self.max_model_len = max_model_len
        self.model = model
        self.tbt_slo_s = tbt_slo_s
        self.ttl_s = ttl_s
        self._gaps = GapTailCalibration(horizon_s=horizon_s, clock=clock)
        self.refused = 0
        self._clock = clock
        self._held: dict[str, _Hold] = {}

    @property
    def committed_blocks(self) -> int:
        """Worst-case blocks of every held request."""
        self._expire()
        return sum(h.blocks for h in self._held.values())

    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """Hold room for a request whose decode job comes after its prefill; or refuse."""
        self._admit(request_id, prompt_tokens, max_tokens, self._clock() + self.ttl_s)

    def claim(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """A decode job arrived: take over its reservation, or admit it now; or refuse."""
        hold = self._held.get(request_id)
        if hold is not None:
            hold.expires_at = None
            return
        self._admit(request_id, prompt_tokens, max_tokens, None)

    def bind(self, request_id: str, finished: Callable[[], bool]) -> None:
        """Let a claimed request go as soon as `finished()` says so, even if never released."""
        hold = self._held.get(request_id)
        if hold is not None:
            hold.finished = finished

    def release(self, request_id: str) -> None:
        """The request's stream ended (or its decode job will never come)."""
        self._held.pop(request_id, None)

    def gap_split(self) -> tuple[float, float]:
        """(measured / modelled step, seconds waited for the cores) of the slow tail of the last
        horizon_s's gaps, judged at the step the held requests and one more would make."""
        if self.model is None:
            return 1.0, 0.0
        self._expire()
        context = sum(h.context for h in self._held.values())
        return self._gaps.split(self.model.decode_step_s(len(self._held) + 1, context))

    def mean_step_ratio(self) -> float:
        """Measured / modelled step over all the last horizon_s's steps (1.0 without a model)."""
        return self._gaps.mean_ratio() if self.model is not None else 1.0

    @property
    def calibration(self) -> float:
        """Measured / modelled step time in the slow tail of recent gaps (`gap_split`)."""
        return self.gap_split()[0]

    @property
    def wait_s(self) -> float:
        """Seconds waited for the cores in the slow tail of recent gaps (`gap_split`)."""
        return self.gap_split()[1]

    def predicted_step_s(self, batch: int, context: int) -> float | None:
        """Calibrated token gap of a batch (step and wait); None without a cost model."""
        if self.model is None:
            return None
        return self._gaps.predict(self.model.decode_step_s(batch, context))

    def seed_quiet_step(self, batch: int, context: int, compute_s: float) -> None:
        """A step timed alone at start-up: gaps are predicted from it while none is recent."""
        if self.model is not None:
            self._gaps.seed_quiet(compute_s, self.model.decode_step_s(batch, context))

    def observe_step(self, batch: int, context: int, compute_s: float,
                     wait_s: float = 0.0) -> None:
        """A decode step this instance ran, and how long it waited first: calibrates later
        predictions."""
        if self.model is None or batch <= 0:
            return
        self._gaps.add(compute_s, self.model.decode_step_s(batch, context), wait_s)

    def _admit(self, request_id: str, prompt_tokens: int, max_tokens: int,
               expires_at: float | None) -> None:
        self._expire()
        total = min(prompt_tokens + max_tokens, self.max_model_len)
        need = -(-total // self.block_tokens)
        others = [h for rid, h in self._held.items() if rid != request_id]
        if others:
            committed = sum(h.blocks for h in others)
            if committed + need > self.total_blocks:
                self.refused += 1
                raise AdmissionRefused(
                    f"decode KV memory: the request may need {need} blocks, {committed} of "
                    f"{self.total_blocks} are committed to {len(others)} requests")
            step = self.predicted_step_s(len(others) + 1,
                                         sum(h.context for h in others) + prompt_tokens)
            if self.tbt_slo_s is not None and step is not None and step > self.tbt_slo_s:
                self.refused += 1
                raise AdmissionRefused(
                    f"decode TBT: a step of {len(others) + 1} requests is predicted at "
                    f"{step * 1000:.0f} ms, above the {self.tbt_slo_s * 1000:g} ms SLO")
        self._held[request_id] = _Hold(need, prompt_tokens, expires_at)

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r for r, h in self._held.items()
                    if (h.expires_at is not None and h.expires_at <= now)
                    or (h.finished is not None and h.finished())]:
            del self._held[rid]
