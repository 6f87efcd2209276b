"""The decode steps a prompt's prefill passes will wait for, as the scheduler predicts them.

On cores a prefill shares with a decode, each cut prefill pass waits for a decode step, and
the step sets how long the pass may run (cost_model/passes.py). Which step depends on who is
decoding when the prompt's passes run: the requests placed before the burst being decided
(`Steps.busy`), until they have streamed what they asked for (`Steps.drain_s`); after them, the
burst's own requests answered before the prompt (`Steps.own`); after the burst's first pass,
that pass's requests with the rest (`Steps.burst`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from mooncake_server.cost_model.passes import pass_budget_s
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler.bursts import BurstState
from mooncake_server.roles.conductor.scheduler.estimators import PrefillEstimate
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.wire.instances import Heartbeat, InstanceInfo


class Steps(NamedTuple):
    """Decode steps (seconds) while a burst is decided: each the mean a step runs at, since a
    prompt's passes wait for many of them."""

    busy: float  # the longest now, of the work placed before the burst (0.0: none)
    burst: float  # the longest once the burst decodes too
    drain_s: float  # until the work placed before the burst has surely ended (inf: unknown)
    own: float  # the longest of the burst's requests placed so far, decoding alone


class DecodeSteps:
    """Decode steps as the ledger and the decode instances' heartbeats say now."""

    def __init__(self, model: PerfModel, registry: InstanceRegistry,
                 tracker: LoadTracker) -> None:
        self.model = model
        self.registry = registry
        self.tracker = tracker

    def now(self, decodes: list[InstanceInfo], burst: BurstState,
            tbt_slo_s: float | None) -> Steps:
        """The steps a prompt of `burst` placed now may wait for."""
        busy = self._busiest(decodes, burst, with_burst=False)
        return Steps(busy, self._busiest(decodes, burst, with_burst=True),
                     self._drain_s(decodes, burst, busy, tbt_slo_s), self._own(decodes, burst))

    def own_step_s(self, instance_id: str, beat: Heartbeat | None, modelled_s: float, *,
                   mean: bool = False) -> float:
        """A decode instance's step modelled at `modelled_s`, scaled by its own measured /
        modelled steps (its heartbeat: their slow tail, which one gap is judged by, or with
        `mean` all of them, which a prompt's many passes wait for), else by the gaps seen here."""
        if beat is not None:
            ratio = beat.step_ratio_mean if mean else None
            ratio = beat.step_ratio if ratio is None else ratio
            if ratio is not None:
                return modelled_s * ratio
        return modelled_s * self.tracker.decode_calibration(instance_id)

    def _busiest(self, decodes: list[InstanceInfo], burst: BurstState, *,
                 with_burst: bool) -> float:
        """The longest decode step now (`with_burst`: once the burst being decided decodes too),
        as each decode instance runs its own (0.0 when every decode idles). The bare built-in
        model (one machine's fp32 steps) charged every cut prefill pass a wait for a step three
        times the one it waited for here.
        """
        steps = [0.0]
        for info in decodes:
            beat = self.registry.load(info.instance_id)
            load = self.tracker.decode_load(info.instance_id, beat)
            if not with_burst and load.batch <= burst.count(info.instance_id):
                continue  # only the burst being decided, still to prefill: idle until then
            if not load.batch:
                continue
            steps.append(self.own_step_s(info.instance_id, beat,
                                         self.model.decode_step_s(load.batch,
                                                                  load.context_tokens),
                                         mean=True))
        return max(steps)

    def _drain_s(self, decodes: list[InstanceInfo], burst: BurstState, busy: float,
                 tbt_slo_s: float | None) -> float:
        """Seconds until every request placed before the burst has surely stopped decoding: its
        tokens left, each a step and the prefill pass beside it (inf: a length unknown, or work
        the heartbeats report that this ledger did not place)."""
        if busy <= 0:
            return 0.0
        gap = busy + (pass_budget_s(tbt_slo_s, busy) if tbt_slo_s is not None else 0.0)
        most = 0
        for info in decodes:
            iid = info.instance_id
            left = self.tracker.decode_steps_left(iid, excluding=burst.ids)
            reported = self.tracker.decode_load(iid, self.registry.load(iid)).batch
            if left is None or reported > self.tracker.decode_load(iid).batch:
                return math.inf
            most = max(most, left)
        return most * gap

    def _own(self, decodes: list[InstanceInfo], burst: BurstState) -> float:
        """The longest step of the burst's requests placed so far, decoding alone."""
        steps = [0.0]
        for info in decodes:
            iid = info.instance_id
            rows = burst.count(iid)
            if rows:
                modelled = self.model.decode_step_s(rows, burst.context.get(iid, 0))
                steps.append(self.own_step_s(iid, self.registry.load(iid), modelled, mean=True))
        return max(steps)


def describe_passes(est: PrefillEstimate, steps: Steps) -> str:
    """How an estimate computes its prompt, for the placement's log line: a misjudged cut-pass
    estimate shows which of its parts (chunk, wait, the steps) was off."""
    if est.pass_tail:
        return "the tail of the burst's first pass, in a forward of its own"
    if est.first_pass:
        return "in the burst's first pass"
    if not est.chunk_tokens:
        return "calibrated"
    return (f"passes of {est.chunk_tokens} tokens after {est.pass_wait_s * 1000:.0f} ms waits; "
            f"decode step {steps.busy * 1000:.0f} ms, {steps.burst * 1000:.0f} ms with the "
            f"burst, {steps.own * 1000:.0f} ms its own; the earlier work ends in "
            f"{steps.drain_s:.2f} s")
