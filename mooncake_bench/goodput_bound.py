"""The most requests any admission could serve within both SLOs on given arrivals: an offline
schedule over costs measured on the idle server (bench_goodput's bound).

Costs: a lone prompt's time to first token fit as `pass_s + token_s·n + pair_s·n²` (the
per-pass cost, the per-token cost, attention growing with the prompt), so a pass of several
prompts pays `pass_s` once and each prompt its own tokens; a decode step as `step_s +
row_s·rows`. One machine does both, as the cores of the benchmark's single host do.

The schedule is the best case for the server, each assumption in its favour:
- a burst's requests are kept shortest first (optimal for a common deadline), and its kept
  prefill runs as one pass, pre-emptible at no cost;
- the requests a burst keeps start decoding together when its prefill ends (their second token
  is held to TTFT + TBT, so waiting for the burst costs them nothing), all rows in one batch;
- while prefill work waits, decoding rows take one step per TBT SLO and no more (the least
  that keeps their gaps within it); with no prefill waiting, steps run back to back;
- the hand-off, queueing and HTTP cost nothing beyond what the lone prompts measured.
Across bursts, how many a burst keeps changes the decode load the next ones meet, so the count
per burst is searched (a beam over the schedules that no other beats on both served requests
and load left). Decode is what the earlier prefill-only bound left out: at the heavy rates a
burst's decoding takes the cores from the next burst's prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

BEAM = 64


@dataclass(frozen=True)
class Costs:
    """Seconds: a prefill pass `pass_s + Σ(token_s·n + pair_s·n²)`, a decode step
    `step_s + row_s·rows`."""

    pass_s: float
    token_s: float
    pair_s: float
    step_s: float
    row_s: float

    def prompt_s(self, tokens: int) -> float:
        """One prompt's share of a pass (its tokens and its own attention)."""
        return self.token_s * tokens + self.pair_s * tokens * tokens

    def decode_step_s(self, rows: int) -> float:
        """One decode step of `rows` sequences."""
        return self.step_s + self.row_s * rows


def fit_prefill(samples: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(pass_s, token_s, pair_s) by least squares over (prompt tokens, seconds), none negative
    (a term that fits negative is dropped and the rest refit)."""
    cols = [0, 1, 2]
    n = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    while True:
        a = np.stack([n ** k for k in cols], axis=1)
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        if (coef >= 0).all() or len(cols) == 1:
            out = [0.0, 0.0, 0.0]
            for k, c in zip(cols, coef, strict=True):
                out[k] = max(0.0, float(c))
            return out[0], out[1], out[2]
        cols.pop(int(np.argmin(coef)))


def fit_decode(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(step_s, row_s) through (rows, step seconds) measured at two or more batch sizes; the
    per-row cost is never negative."""
    rows = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    if len(set(rows)) < 2:
        return float(y.min()), 0.0
    slope, icpt = np.polyfit(rows, y, 1)
    if slope < 0:
        return float(y.min()), 0.0
    return float(icpt), float(slope)


@dataclass(frozen=True)
class Request:
    """One request as the schedule sees it: uncached prompt tokens, tokens it asks for."""

    tokens: int
    outputs: int


@dataclass
class _Work:
    """A burst's kept prefill: machine seconds left, its deadline, the rows it starts."""

    left_s: float
    deadline: float
    rows: list[int]


@dataclass
class _State:
    """The schedule at time `t`: prefill queued (earliest deadline first), decoding rows (steps
    left each) and requests served so far."""

    t: float
    served: int = 0
    queue: list[_Work] = field(default_factory=list)
    rows: list[float] = field(default_factory=list)

    def copy(self) -> _State:
        """A copy that can run on without changing this one."""
        return replace(self, queue=[replace(w, rows=list(w.rows)) for w in self.queue],
                       rows=list(self.rows))

    def load_s(self, costs: Costs) -> float:
        """Machine seconds still owed: queued prefill plus the decoding rows run back to back."""
        steps = sorted(self.rows)
        owed, done = 0.0, 0.0
        for i, s in enumerate(steps):
            owed += (s - done) * costs.decode_step_s(len(steps) - i)
            done = s
        return owed + sum(w.left_s for w in self.queue)


def _run(state: _State, until: float, costs: Costs, tbt_slo: float) -> bool:
    """Advance `state` to `until`; False when queued prefill misses its deadline (or a batch
    could not step within the TBT SLO)."""
    eps = 1e-9
    while state.t < until - eps:
        step = costs.decode_step_s(len(state.rows)) if state.rows else 0.0
        if step > tbt_slo:
            return False
        if state.queue:
            # Prefill waits: rows step once per TBT SLO, prefill gets the rest of the machine.
            step_rate = 1.0 / tbt_slo if state.rows else 0.0
            prefill_rate = max(eps, 1.0 - step * step_rate)
            head = state.queue[0]
            dt = min(until - state.t, head.left_s / prefill_rate)
        else:
            step_rate = 1.0 / max(step, eps) if state.rows else 0.0
            prefill_rate, head = 0.0, None
            dt = until - state.t
        if state.rows:
            dt = min(dt, min(state.rows) / step_rate)
        state.t += dt
        state.rows = [r - dt * step_rate for r in state.rows if r - dt * step_rate > eps]
        if head is not None:
            head.left_s -= dt * prefill_rate
            if head.left_s <= eps:
                if state.t > head.deadline + eps:
                    return False
                state.queue.pop(0)
                state.rows.extend(head.rows)
    return all(w.deadline > state.t + eps or w.left_s <= eps for w in state.queue)


def _keep(state: _State, arrive: float, burst: list[Request], count: int, costs: Costs,
          ttft_slo: float) -> _State:
    """`state` with the burst's `count` cheapest requests queued for prefill."""
    kept = sorted(burst, key=lambda r: r.tokens)[:count]
    nxt = state.copy()
    if kept:
        work = costs.pass_s + sum(costs.prompt_s(r.tokens) for r in kept)
        nxt.queue.append(_Work(work, arrive + ttft_slo, [max(0, r.outputs - 1) for r in kept]))
        nxt.queue.sort(key=lambda w: w.deadline)
        nxt.served += count
    return nxt


def best_served(bursts: dict[float, list[Request]], costs: Costs, ttft_slo: float,
                tbt_slo: float) -> int:
    """Most requests of `bursts` (arrival seconds -> requests) served within both SLOs by the
    schedule described in the module docstring."""
    times = sorted(bursts)
    beam = [_State(times[0] if times else 0.0)]
    for i, arrive in enumerate(times):
        until = times[i + 1] if i + 1 < len(times) else arrive + ttft_slo
        grown: list[_State] = []
        for state in beam:
            if not _run(state, arrive, costs, tbt_slo):
                continue
            for count in range(len(bursts[arrive]), -1, -1):
                nxt = _keep(state, arrive, bursts[arrive], count, costs, ttft_slo)
                if _run(nxt, until, costs, tbt_slo):
                    grown.append(nxt)
        beam = _pareto(grown, costs)
    return max((s.served for s in beam), default=0)


def _pareto(states: list[_State], costs: Costs) -> list[_State]:
    """The states no other beats on both served (more) and load owed (less), at most BEAM."""
    out: list[_State] = []
    best_load = math.inf
    for s in sorted(states, key=lambda s: (-s.served, s.load_s(costs))):
        load = s.load_s(costs)
        if load < best_load:
            out.append(s)
            best_load = load
    return out[:BEAM]
