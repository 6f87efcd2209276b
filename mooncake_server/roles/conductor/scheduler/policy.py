"""Algorithm 1 of the paper: KVCache-centric placement + SLO early rejection, one `Plan` per request.

Per request, once: the prefix oracle says how much of the prompt is cached where; every live
prefill instance gets a TTFT estimate (queue + transfer of the prefix it lacks + prefill of the
rest) and every live decode instance a TBT estimate (its batch with this request in it). The
policy picks the pair (paper Fig. 5 ablation):
  random        any live prefill and decode instance;
  load          the shortest prefill queue, the smallest decode batch; caches ignored;
  cache-local   lowest TTFT counting only prefixes an instance holds locally;
  cache-global  lowest TTFT counting the global store too: an instance that lacks the prefix
                fetches it when that beats recomputing (cache load balancing, §4.2).
If `--ttft-slo` / `--tbt-slo` cannot be met by the chosen pair, the request is rejected at once
(HTTP 429 + Retry-After) instead of queueing behind work that would break its SLO. With SLOs,
requests that arrive together are decided together, cheapest first (api/burst.py); each accepted
one's prefill must start by a deadline (`Plan.start_by`), or the prefill instance turns it away
with 429 before computing it. A burst's prompts that fit the instance's first full pass are
estimated in it; the rest in cut passes beside the decode of that pass's requests (bursts.py).
TBT is the decode's steady steps (and, on cores a prefill shares, the pass it waits behind); the
hand-off from prefill to decode (KV load, joining the batch) is time to the second token,
budgeted as TTFT + TBT.
The plan also says what the prefill instance may reuse (`PrefillJob.reuse`): `global` (fetch the
prefix it lacks from the store) only under cache-global when the estimate chose fetching;
otherwise `local`, the blocks in its own prefix cache. A decode instance that refuses the request
at admission (its KV memory or TBT would not allow it) is replaced by the next best one
(`repick_decode`); when none is left the request gets a 429 before prefill starts.
The plan is a value: the request path keeps it and replaces its instances when the request
moves; the scheduler keeps only its ledger of work in flight (`LoadTracker`).
"""

from __future__ import annotations

import enum
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import NamedTuple

from mooncake_server.api.backend import BackendError, GenerateRequest
from mooncake_server.api.burst import BURST_WINDOW_S, BurstGate, Order
from mooncake_server.cost_model.passes import (
    HOLD_MARGIN_S,
    LONG_PASS_SHARE,
    chunk_fitting,
    pass_budget_s,
)
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler.bursts import (
    FIRST_PASS_CHUNKS,
    TAIL_SLO_SHARE,
    BurstState,
    first_pass_share,
    settle,
)
from mooncake_server.roles.conductor.scheduler.decode_steps import (
    DecodeSteps,
    Steps,
    describe_passes,
)
from mooncake_server.roles.conductor.scheduler.estimators import (
    Passes,
    PrefillEstimate,
    estimate_prefill,
    estimate_tbt,
    judged_ttft_s,
    reusable_blocks,
)
from mooncake_server.roles.conductor.scheduler.load import HANDOFF_STEPS, LoadTracker
from mooncake_server.roles.conductor.scheduler.oracle import (
    STORE_WIDE,
    NoPrefixOracle,
    PrefixOracle,
)
from mooncake_server.roles.conductor.scheduler.outcomes import RequestOutcomes
from mooncake_server.wire.instances import Heartbeat, InstanceInfo, PassSplit
from mooncake_server.wire.jobs import Reuse

log = logging.getLogger(__name__)

_MAX_RETRY_AFTER_S = 60.0
# Token gaps a request's hand-off is spread over when decode instances are ranked.
_RANK_GAPS = 8


class Policy(str, enum.Enum):
    """How the prefill / decode pair is chosen (`--policy`; values = config.POLICIES)."""

    RANDOM = "random"
    LOAD = "load"
    CACHE_LOCAL = "cache-local"
    CACHE_GLOBAL = "cache-global"



class SLORejected(BackendError):
    """No instance pair can meet the SLOs: HTTP 429 with `Retry-After`, before any work."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, 429, code="slo_unattainable", retry_after_s=retry_after_s)


class Plan(NamedTuple):
    """Where one request runs and what the scheduler expects of it."""

    prefill: InstanceInfo
    decode: InstanceInfo
    prefill_estimate: PrefillEstimate
    tbt_s: float
    reuse: Reuse = "local"  # PrefillJob.reuse: local | global
    cached_blocks: int = 0  # leading prompt blocks the global store holds (STORE_WIDE hits)
    order: Order | None = None  # its place in the prefill queue (decided in a burst)
    # With --ttft-slo: the time.monotonic() by which its prefill must start to meet it (real
    # time, whatever clock the ledger runs on: the request path compares it with the wall).
    start_by: float | None = None
    request_id: str = ""
    # ... and by which its first token is due (the prefill answers a first pass's done jobs
    # early rather than let them miss it).
    answer_by: float | None = None
    # After its burst's first pass: computed in one forward with the job placed before it.
    batched: bool = False
    arrived_at: float | None = None  # time.monotonic() the request came

    @property
    def first_pass(self) -> bool:
        """Its prefill joins its burst's first full pass (bursts.py)."""
        return self.prefill_estimate.first_pass

    @property
    def expect_by(self) -> float | None:
        """The time.monotonic() its first token is estimated by (after `settle`, too)."""
        return None if self.arrived_at is None else self.arrived_at + self.prefill_estimate.ttft_s


class _DecodeChoice(NamedTuple):
    info: InstanceInfo
    tbt_s: float
    fits: bool  # its KV memory can hold the request now
    handoff_s: float = 0.0  # from its first token (prefill) to its second (this decode)


class KVCacheScheduler:
    """Chooses store, prefill and decode instances per Algorithm 1; rejects early on SLOs."""

    def __init__(self, registry: InstanceRegistry, model: PerfModel, *,
                 policy: Policy | str = Policy.CACHE_GLOBAL, block_tokens: int,
                 oracle: PrefixOracle | None = None, ttft_slo_s: float | None = None,
                 tbt_slo_s: float | None = None, tracker: LoadTracker | None = None,
                 rng: random.Random | None = None,
                 burst_window_s: float = BURST_WINDOW_S) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.registry = registry
        self.model = model
        self.policy = Policy(policy)
        self.block_tokens = block_tokens
        self.oracle: PrefixOracle = oracle or NoPrefixOracle()
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.tracker = tracker or LoadTracker()
        registry.on_register(lambda info: self.tracker.registered(info.instance_id,
                                                                  info.incarnation))
        registry.on_heartbeat(lambda beat: self.tracker.heard(beat.instance_id))
        self.rejected = 0
        self.outcomes = RequestOutcomes(ttft_slo_s, tbt_slo_s)
        self._rng = rng or random.Random()
        self.gate: BurstGate[tuple[GenerateRequest, dict[str, int], float], Plan | None] = \
            BurstGate(lambda item, order: self._place(*item, order=order),
                      window_s=burst_window_s, settle=self._settle)
        self._burst = BurstState()  # the burst being decided: what was placed where

    # ---- Algorithm 1 --------------------------------------------------------------------------

    async def plan(self, request: GenerateRequest, keys: Sequence[str]) -> Plan | None:
        """Place `request` (one oracle query), record it in the ledger; None if a role is missing.

        With SLOs it is decided in its burst (cheapest first). Raises SLORejected when the SLOs
        cannot be met.
        """
        arrived = self.tracker.now()
        hits = await self.oracle.longest_prefix(keys) if keys else {}
        if self.ttft_slo_s is None and self.tbt_slo_s is None:
            return self._place(request, hits)
        return await self.gate.admit((request, hits, arrived),
                                     self._uncached_tokens(request, hits))

    def _uncached_tokens(self, request: GenerateRequest, hits: dict[str, int]) -> int:
        """The prompt tokens its best-placed prefill would compute: its cost in a burst."""
        n = len(request.prompt_token_ids)
        cap = reusable_blocks(n, self.block_tokens)
        return n - min(max(hits.values(), default=0), cap) * self.block_tokens

    def _place(self, request: GenerateRequest, hits: dict[str, int],
               arrived: float | None = None, order: Order | None = None) -> Plan | None:
        """Decide (`arrived`: when `plan` got it, the ledger's clock), then record it there."""
        burst_at = order.burst_at if order is not None else None
        if burst_at is None or self._burst.at != burst_at:
            self._burst = BurstState(burst_at)
        waited = 0.0 if arrived is None else max(0.0, self.tracker.now() - arrived)
        plan = self.decide(request, hits, waited_s=waited)
        if plan is not None:
            est = plan.prefill_estimate
            # The ledger stores the uncalibrated estimate; it applies the calibration itself.
            uncalibrated = est.compute_s / est.calibration + est.transfer_s
            self.tracker.assign(request.request_id, est.instance_id, uncalibrated,
                                plan.decode.instance_id, len(request.prompt_token_ids),
                                own_split=est.split, max_tokens=request.sampling.max_tokens,
                                choices=request.sampling.n)
            self.outcomes.placed(request.request_id, est.ttft_s, plan.tbt_s)
            arrived_at = time.monotonic() - waited
            due = None if self.ttft_slo_s is None else arrived_at + self.ttft_slo_s
            start_by = None if due is None else due - est.compute_s - est.transfer_s
            n, iid = len(request.prompt_token_ids), est.instance_id
            batched = not plan.first_pass and self._burst.batched(iid, n, est.chunk_tokens)
            plan = plan._replace(order=order, start_by=start_by, answer_by=due, batched=batched,
                                 arrived_at=arrived_at)
            self._burst.record(request.request_id, iid, plan.decode.instance_id, n,
                               plan.first_pass, est.chunk_tokens)
        return plan

    def _settle(self, plans: list[Plan | None]) -> list[Plan | None]:
        """A decided burst's plans as its prefill instances will run them (bursts.settle)."""
        settled = settle(plans)
        for before, after in zip(plans, settled, strict=True):
            if after is not None and before is not None and after.prefill_estimate != \
                    before.prefill_estimate:
                self.outcomes.placed(after.request_id, after.prefill_estimate.ttft_s,
                                     after.tbt_s)
        return settled

    def decide(self, request: GenerateRequest, hits: dict[str, int], *,
               waited_s: float = 0.0) -> Plan | None:
        """The placement for `request` given prefix hits (blocks), `waited_s` after it came (a
        burst's gathering, part of its TTFT); raises SLORejected."""
        prefills = self.registry.alive("prefill")
        decodes = self.registry.alive("decode")
        if not prefills or not decodes:
            return None
        n = len(request.prompt_token_ids)
        steps = self._steps().now(decodes, self._burst, self.tbt_slo_s)
        estimates = [self._estimate(info, n, hits, steps, waited_s) for info in prefills]
        choices = [self._decode_choice(info, request) for info in decodes]
        if self.policy is Policy.RANDOM:
            best_p = self._rng.choice(estimates)
        elif self.policy is Policy.LOAD:
            best_p = min(estimates, key=lambda e: (
                e.queue_s, self.tracker.prefill_queue_len(e.instance_id), e.instance_id))
        else:
            best_p = min(estimates, key=lambda e: (e.ttft_s, e.instance_id))
        best_d = self._best_decode(choices)
        self._check_slos(request, best_p, best_d)
        # One line per placement: with the client's TTFT / TBT it tells a misjudged admission
        # (estimate under the SLO, measurement over it) from an overloaded one.
        provisional = (self.ttft_slo_s is not None and best_p.ttft_s > self.ttft_slo_s)
        log.info("placing %s (%d prompt tokens, %d reused) on %s / %s: estimated TTFT %.2f s "
                 "(queue %.2f s, %s), TBT %.0f ms%s", request.request_id, n, best_p.reused_tokens,
                 best_p.instance_id, best_d.info.instance_id, best_p.ttft_s, best_p.queue_s,
                 describe_passes(best_p, steps), best_d.tbt_s * 1000,
                 "; its cut passes' speed is not timed yet: it starts only by its deadline"
                 if provisional else "")
        prefill = next(i for i in prefills if i.instance_id == best_p.instance_id)
        reuse = ("global" if self.policy is Policy.CACHE_GLOBAL and best_p.fetched_tokens
                 else "local")
        return Plan(prefill, best_d.info, best_p, best_d.tbt_s, reuse,
                    cached_blocks=hits.get(STORE_WIDE, 0), request_id=request.request_id)

    def _best_decode(self, choices: list[_DecodeChoice]) -> _DecodeChoice:
        if self.policy is Policy.RANDOM:
            return self._rng.choice(choices)
        if self.policy is Policy.LOAD:
            return min(choices, key=lambda c: (
                self.tracker.decode_load(c.info.instance_id).batch, c.info.instance_id))
        fitting = [c for c in choices if c.fits] or choices
        # Ranked by the mean gap a request would see: steady steps plus the hand-off spread
        # over its gaps (a slow hand-off, a cold start's say, weighs as one gap in eight).
        return min(fitting, key=lambda c: (c.tbt_s + c.handoff_s / _RANK_GAPS,
                                           c.info.instance_id))

    def _steps(self) -> DecodeSteps:
        """The decode steps as this scheduler's ledger and registry say now."""
        return DecodeSteps(self.model, self.registry, self.tracker)

    def _passes(self, instance_id: str, beat: Heartbeat | None, steps: Steps,
                prompt_tokens: int, queue_s: float,
                held: bool = False) -> tuple[Passes | None, bool]:
        """How a prompt placed now on the instance will be computed, by its own account, and
        whether it joins its burst's first full pass.

        Its passes are cut while a decode on its cores has work: one does now (`steps.busy`),
        the jobs queued ahead of its burst hand theirs on while it waits, or it runs after its
        burst's first pass, beside that pass's decoding requests (`steps.burst`). Each cut pass
        waits for a decode step, at least the modelled step of the largest batch, and takes what
        that step leaves of the TBT SLO (cost_model/passes.py). A prompt that starts (after
        `queue_s`) once the work placed before its burst has ended waits only for the steps of
        its burst's requests placed before it (`steps.own`), or (`held`, with a TTFT SLO)
        none: the instance holds those requests' hand-off while prompts are queued behind
        them (prefill/hand_on.py), so its passes run whole.
        """
        split = beat.passes if beat is not None else None
        if split is None:
            return None, False
        if not split.shared:
            return Passes(split.chunk_tokens, split.ratio), False
        if self._queued_before_burst(instance_id, beat, steps.busy):
            own_only = queue_s >= steps.drain_s and not self._queued_ahead(instance_id, beat)
            step = steps.own if own_only else steps.busy
        elif not self._burst.fits_first_pass(instance_id, prompt_tokens,
                                             self._first_pass_cap(split)):
            own_only, step = True, max(steps.busy, steps.burst)
        else:
            return Passes(split.chunk_tokens, split.ratio), True
        if own_only and held and self.ttft_slo_s is not None:
            return Passes(split.chunk_tokens, split.ratio, held=True), False
        chunk = split.cut_tokens
        if self.tbt_slo_s is not None:
            chunk = chunk_fitting(self.model, split.cut_ratio,
                                  pass_budget_s(self.tbt_slo_s, step), split.cut_tokens)
        # Untimed, the cut speed is a prior for this prompt and for the burst's cut passes ahead
        # of it; not for a first pass or earlier bursts' jobs ahead (estimators.judged_ttft_s).
        prior = (not split.cut_timed and not self._queued_ahead(instance_id, beat)
                 and not self._burst.first_pass.get(instance_id, 0))
        return Passes(chunk, split.cut_ratio, max(split.wait_s, step), prior=prior), False

    def _first_pass_cap(self, split: PassSplit) -> int:
        """Prompt tokens a burst's first pass may hold: more than a chunk only with a TTFT SLO,
        which then bounds how long the pass may run, and once the instance has timed passes
        long enough to predict it (bursts.FIRST_PASS_CHUNKS, passes.LONG_PASS_SHARE)."""
        chunk = split.chunk_tokens
        if self.ttft_slo_s is None or split.measured_tokens < LONG_PASS_SHARE * chunk:
            return chunk
        return chunk * FIRST_PASS_CHUNKS

    def _queued_before_burst(self, instance_id: str, beat: Heartbeat | None,
                             busy_step: float) -> bool:
        """A decode has work now, or jobs ahead of the burst being decided do (they hand theirs
        on while the burst waits). A burst's own jobs do not count: the instance batches them
        into full passes (counted as cutting, a burst's 500-token prompts were estimated at
        5.4 s behind two 1-token ones, and the burst ran whole in 1.9 s)."""
        return busy_step > 0 or self._queued_ahead(instance_id, beat)

    def _queued_ahead(self, instance_id: str, beat: Heartbeat | None) -> bool:
        """Prefill jobs of earlier bursts are queued or running on the instance."""
        return self.tracker.prefill_queue_len(instance_id, beat) > self._burst.count(instance_id)

    def _estimate(self, info: InstanceInfo, prompt_tokens: int, hits: dict[str, int],
                  steps: Steps, waited_s: float = 0.0) -> PrefillEstimate:
        bt = self.block_tokens
        cap = reusable_blocks(prompt_tokens, bt)
        local = min(hits.get(info.instance_id, 0), cap) * bt
        remote = min(hits.get(STORE_WIDE, 0), cap) * bt
        if self.policy is Policy.CACHE_LOCAL:
            remote = 0  # an instance reuses only what it holds itself
        beat = self.registry.load(info.instance_id)
        iid = info.instance_id
        queue_s = self.tracker.prefill_queue_s(iid, beat)

        def estimate(held: bool) -> tuple[Passes | None, bool, int, PrefillEstimate]:
            passes, first = self._passes(iid, beat, steps, prompt_tokens, queue_s, held)
            chunk = passes.chunk_tokens if passes is not None else 0
            return passes, first, chunk, estimate_prefill(
                self.model, iid, prompt_tokens, local_tokens=local, remote_tokens=remote,
                queue_s=queue_s, calibration=self.tracker.calibration(iid), passes=passes,
                joins_pass=self._burst.shares_forward(iid, prompt_tokens, chunk) if first
                else self._burst.joins_batch(iid, prompt_tokens, chunk))

        for _ in range(2):
            passes, first, chunk, est = estimate(held=True)
            if passes is not None and passes.held and self.ttft_slo_s is not None \
                    and est.ttft_s + waited_s > self.ttft_slo_s - HOLD_MARGIN_S:
                # Past it the held requests go on and its last passes run cut beside them.
                passes, first, chunk, est = estimate(held=False)
            if not (first and self.ttft_slo_s is not None
                    and self._burst.past_one_chunk(iid, prompt_tokens, chunk)):
                break
            overrun = self.outcomes.overrun()
            share = first_pass_share(overrun)
            alone = not self._burst.first_pass.get(iid, 0)  # no forward before it to time
            limit = share if alone else TAIL_SLO_SHARE
            if not alone:
                # The prompt that takes the pass past one chunk is its tail (bursts.py), in a
                # forward of its own, whose fixed cost is not shared.
                est = estimate_prefill(self.model, iid, prompt_tokens, local_tokens=local,
                                       remote_tokens=remote, queue_s=queue_s,
                                       calibration=self.tracker.calibration(iid),
                                       passes=passes)._replace(pass_tail=True)
            fits = est.ttft_s + waited_s <= limit * self.ttft_slo_s
            if not (alone and fits):
                self._burst.full.add(iid)  # every costlier prompt: after the pass
            if fits:
                break
            log.info("the first pass on %s takes no %d-token prompt: it would end at an "
                     "estimated %.2f s, past %.2f of the TTFT SLO (long estimates ran over by "
                     "up to %s lately)", iid, prompt_tokens, est.ttft_s + waited_s, limit,
                     "-" if overrun is None else f"{overrun:.2f}x")
        return est._replace(ttft_s=est.ttft_s + waited_s, waited_s=waited_s, first_pass=first,
                            chunk_tokens=chunk,
                            pass_wait_s=passes.wait_s if passes is not None else 0.0,
                            cut_prior=passes is not None and passes.prior)

    def _decode_choice(self, info: InstanceInfo, request: GenerateRequest) -> _DecodeChoice:
        beat = self.registry.load(info.instance_id)
        load = self.tracker.decode_load(info.instance_id, beat)
        n = len(request.prompt_token_ids)
        step = estimate_tbt(self.model, load, n)
        iid = info.instance_id
        own = self._steps().own_step_s(iid, beat, step)
        # The instance reports its wait for the cores (a prefill pass beside it) apart from its
        # step: the wait does not scale with the batch. Gaps seen here mix the two in one ratio.
        wait = (beat.wait_s or 0.0) if beat is not None else 0.0
        if self.tbt_slo_s is not None and self._prefill_beside():
            # Any prompt that comes while this request decodes runs in passes beside its steps,
            # each as long as the step leaves of the SLO: the gaps it will be judged by.
            wait = max(wait, pass_budget_s(self.tbt_slo_s, own))
        steady = own + wait
        handoff = max(HANDOFF_STEPS * own, self.tracker.handoff_s(iid))
        need = -(-(n + request.sampling.max_tokens) // self.block_tokens)
        fits = beat is None or beat.free_blocks is None or beat.free_blocks >= need
        return _DecodeChoice(info, steady, fits, handoff)

    def _prefill_beside(self) -> bool:
        """A live prefill instance shares its cores with a decode (it says so in its beats)."""
        for info in self.registry.alive("prefill"):
            beat = self.registry.load(info.instance_id)
            if beat is not None and beat.passes is not None and beat.passes.shared:
                return True
        return False

    def _check_slos(self, request: GenerateRequest, best_p: PrefillEstimate,
                    best_d: _DecodeChoice) -> None:
        problems = []
        retry = 1.0
        ttft = judged_ttft_s(best_p)
        if self.ttft_slo_s is not None and ttft > self.ttft_slo_s:
            problems.append(f"estimated TTFT {best_p.ttft_s:.2f} s exceeds the "
                            f"{self.ttft_slo_s:g} s SLO (--ttft-slo)")
            # The queue must drain by the excess before a request like this one fits.
            retry = max(retry, best_p.ttft_s - self.ttft_slo_s)
        if self.tbt_slo_s is not None and (best_d.tbt_s > self.tbt_slo_s or not best_d.fits):
            what = (f"estimated TBT {best_d.tbt_s * 1000:.0f} ms exceeds the "
                    f"{self.tbt_slo_s * 1000:g} ms SLO (--tbt-slo)" if best_d.fits
                    else "no decode instance has KV memory for it")
            problems.append(what)
        if (self.ttft_slo_s is not None and self.tbt_slo_s is not None
                and request.sampling.max_tokens > 1 and not problems):
            # The second token comes after the hand-off: its budget is one TTFT and one TBT.
            second = ttft + best_d.handoff_s
            if second > self.ttft_slo_s + self.tbt_slo_s:
                problems.append(f"estimated time to the second token {second:.2f} s exceeds "
                                f"the TTFT + TBT SLOs ({self.ttft_slo_s + self.tbt_slo_s:g} s)")
                retry = max(retry, second - self.ttft_slo_s - self.tbt_slo_s)
        if not problems:
            return
        self.rejected += 1
        retry = min(_MAX_RETRY_AFTER_S, math.ceil(retry))
        log.info("rejecting %s (%d prompt tokens): %s", request.request_id,
                 len(request.prompt_token_ids), "; ".join(problems))
        raise SLORejected(f"server overloaded: {'; '.join(problems)}; retry in {retry:g} s",
                          retry)

    # ---- the ledger's feedback -------------------------------------------------------------------

    def first_token(self, request_id: str) -> None:
        """The request's prefill finished."""
        self.outcomes.first_token(request_id)
        self.tracker.prefill_done(request_id)

    def handed_on(self, request_id: str) -> None:
        """The request's prefill, which held its hand-off while prompts behind it ran, sent
        it on to its decode now."""
        self.tracker.handed_on(request_id)

    def token(self, request_id: str) -> None:
        """The request decoded one more token (its gap calibrates the decode estimates)."""
        self.outcomes.token(request_id)
        decode_id = self.tracker.decode_of(request_id)
        predicted = None
        if decode_id is not None:
            load = self.tracker.decode_load(decode_id)
            predicted = self.model.decode_step_s(load.batch, load.context_tokens)
        self.tracker.token(request_id, predicted)

    def follow_decode(self, request_id: str, decode_id: str) -> None:
        """The request moved to another decode instance: its load counts there now."""
        self.tracker.move_decode(request_id, decode_id)

    def release(self, request_id: str) -> None:
        """The request ended, whatever the outcome."""
        self.outcomes.finished(request_id)
        self.tracker.finished(request_id)

    # ---- decode admission ---------------------------------------------------------------------

    def repick_decode(self, request: GenerateRequest,
                      refused: set[str]) -> InstanceInfo | None:
        """The next decode instance after `refused` ones turned the request away at admission
        (the ledger moves the request there; the caller updates its plan).

        None when no other one is alive, or (with --tbt-slo) none is predicted to keep it.
        """
        decodes = [d for d in self.registry.alive("decode") if d.instance_id not in refused]
        if not decodes:
            return None
        best = self._best_decode([self._decode_choice(d, request) for d in decodes])
        if self.tbt_slo_s is not None and (best.tbt_s > self.tbt_slo_s or not best.fits):
            return None
        self.tracker.move_decode(request.request_id, best.info.instance_id)
        return best.info
