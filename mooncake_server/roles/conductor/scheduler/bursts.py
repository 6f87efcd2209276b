"""What the scheduler keeps about the burst it is deciding, and how a decided burst is settled.

A prefill instance batches a burst's jobs, in rank order, into one first pass as long as their
prompts fit its chunk (--prefill-chunk), or with a TTFT SLO `FIRST_PASS_CHUNKS` chunks run back
to back, every job answered when the last ends (roles/prefill/job_queue.py); the first job that
does not fit, and every one after it, runs after that pass, while the pass's requests decode
beside it, so in short cut passes that each wait for a decode step. In a replay a 1,518-token
prompt estimated as if it ran at full speed took 11.6 s behind a burst's first pass (est. under
5 s). So the burst is tracked per prefill instance: the prompt tokens its first pass holds so
far, and whether that pass is full.

Once the burst is decided (`settle`): the ranks are renumbered per prefill instance (the
instance waits for the ranks before its head, and ranks sent elsewhere never come), each job
says how many ranks share its first pass (the instance waits for all of them before starting
it: a pass started with the first arrivals left the rest to later passes, 2 s apart), and
every request of a first pass is predicted to answer when the pass ends, which it does, and must
start by the pass's deadline, not its own. So is every request of a batch after it that one
forward computes (`Plan.batched`): a burst's eight prompts of 1-534 tokens, estimated one after
the other at 0.16-1.55 s, were computed in one 1,567-token forward and all answered at 2.3 s
(TTFT measured / estimated p90 12.6 in a goodput replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake_server.api.burst import Order

# NOTE: with a TTFT SLO a burst's first pass may take this many chunks: the requests whose
# prompts a chunk leaves out would otherwise run in cut passes beside the decoding of the rest
# (a 734-token prompt behind a 1,692-token first pass was estimated at 7.2 s and refused; in
# the same first pass, 3.4 s). The SLO bounds the pass's time; this bounds the KV it holds at
# once on the prefill instance (two 2,048-token chunks of the bundled model: 190 MB in fp32).
FIRST_PASS_CHUNKS = 2
# NOTE: a lone prompt past one chunk (no tail: see TAIL_SLO_SHARE) makes a first pass only while
# its estimated end stays within a share of the TTFT SLO: the pass answers all its jobs when it
# ends, so one that runs long makes them all miss at once. The estimate reads the host's speed
# of the last minute, and on a shared host that moves between two passes: in goodput replays on
# the 2-core AMD machine a 2,048-token forward took 3.61 s and, 12 s later, 4.19 s, and such
# passes measured 1.05-1.23x their estimates (once 1.35x). At 0.9 of the SLO, in one benchmark
# run, two such passes (estimated 4.46 and 4.47 s) ran 1.12 and 1.23x and their 12 and 9
# requests missed. At a fixed 0.8, on a steadier host where long passes ran 0.91-0.97x their
# estimates, it turned away one prompt per burst that the pass had room for (a 1,518-token one
# that would have ended the pass at an estimated 4.58 s, a 730-token one at 4.61 s). So the
# share follows how far the long estimates ran over lately (`first_pass_share`): the pass must
# end within the SLO even if it runs `FIRST_PASS_DRIFT` times further over its estimate than the
# worst of them, within these bounds.
FIRST_PASS_SLO_SHARE = (0.8, 0.95)
# NOTE: how much further over its estimate the next long pass may run than the worst recent
# one: on the steadier host, one burst's pass ran 1.02x its estimate and a later one 1.09x.
FIRST_PASS_DRIFT = 1.1
# NOTE: the overrun assumed until a long estimate has ended: a run's first burst is estimated
# from the pass the prefill instance timed at start-up, and measured 0.92-1.05x that estimate
# in the benchmark's runs (a share of 0.85 of the SLO).
UNMEASURED_OVERRUN = 1.07
# NOTE: the share that margin guards is the pass's jobs answered at its end. The prompt that
# takes a pass past one chunk joins it as its tail, whatever the share, if the pass with it ends
# within this share: it runs in a forward of its own after the others' (roles/prefill/
# job_queue.py, `tail_late`), and starts only if, at the speed those forwards just ran, it would
# end within its deadline; otherwise it is refused (429) before any work and the others are
# answered at once. Nothing joins the pass after it. Sharing the others' forwards within the
# share, a 1,518-token prompt crossed into its pass's second forward; the first ran 1.15x its
# estimate, the prefill answered the nine jobs computed, and their decoding cut the rest of the
# long prompt (answered at 6.47 and 7.53 s against a 5 s SLO). The share had turned away
# one such prompt per point in goodput replays where the pass with it measured within the SLO
# (734 tokens at an estimated 4.30 s, past 0.85 of a 5 s SLO; the same pass measured 4.16 s
# in another run). The prefill's check at the speed measured is the margin, so the tail's
# estimate need only be within the SLO itself: at 0.95 of it, a 730-token tail estimated at
# 4.87 s was turned away where the forwards before it ran 0.90x their estimate (3.17 s).
TAIL_SLO_SHARE = 1.0


def first_pass_share(overrun: float | None) -> float:
    """The share of the TTFT SLO a burst's first pass past one chunk may take, given the most a
    long TTFT estimate ran over lately (measured / estimated; None: none measured)."""
    low, high = FIRST_PASS_SLO_SHARE
    if overrun is None or overrun <= 0:
        overrun = UNMEASURED_OVERRUN
    return min(high, max(low, 1.0 / (overrun * FIRST_PASS_DRIFT)))


if TYPE_CHECKING:
    from mooncake_server.roles.conductor.scheduler.estimators import PrefillEstimate
    from mooncake_server.roles.conductor.scheduler.policy import Plan


@dataclass
class BurstState:
    """The burst being decided: what was placed where."""

    at: float | None = None
    placed: dict[str, int] = field(default_factory=dict)  # instance -> requests placed on it
    first_pass: dict[str, int] = field(default_factory=dict)  # prefill -> its first pass's tokens
    full: set[str] = field(default_factory=set)  # prefills whose first pass takes no more
    ids: set[str] = field(default_factory=set)  # its requests placed so far
    context: dict[str, int] = field(default_factory=dict)  # decode -> its prompt tokens there
    # prefill -> prompt tokens of the batch its last job after the first pass opened
    batch: dict[str, int] = field(default_factory=dict)
    # prefill -> the chunk that batch was opened with (the instance takes it whole at once)
    batch_chunk: dict[str, int] = field(default_factory=dict)

    def count(self, instance_id: str) -> int:
        """Requests of this burst placed on the instance so far."""
        return self.placed.get(instance_id, 0)

    def fits_first_pass(self, instance_id: str, prompt_tokens: int, cap_tokens: int) -> bool:
        """Whether a prompt placed now joins the burst's first full pass on the instance (one
        that holds at most `cap_tokens`)."""
        if instance_id in self.full:
            return False
        held = self.first_pass.get(instance_id, 0)
        return not held or held + prompt_tokens <= cap_tokens

    def past_one_chunk(self, instance_id: str, prompt_tokens: int, chunk_tokens: int) -> bool:
        """Whether the first pass, with this prompt in it, holds more than one chunk."""
        return self.first_pass.get(instance_id, 0) + prompt_tokens > chunk_tokens

    def shares_forward(self, instance_id: str, prompt_tokens: int, chunk_tokens: int) -> bool:
        """Whether a prompt joining the first pass adds no forward to it: the pass runs as
        forwards of `chunk_tokens`, and this prompt's tokens end inside the last one."""
        held = self.first_pass.get(instance_id, 0)
        c = max(1, chunk_tokens)
        return held > 0 and -(-(held + prompt_tokens) // c) == -(-held // c)

    def joins_batch(self, instance_id: str, prompt_tokens: int, chunk_tokens: int) -> bool:
        """Whether a prompt after the first pass is batched with the job placed before it: the
        instance takes the next job and those after it that fit in one chunk beside it
        (roles/prefill/job_queue.py), and computes them in one pass."""
        held = self.batch.get(instance_id, 0)
        return held > 0 and held + prompt_tokens <= chunk_tokens

    def batched(self, instance_id: str, prompt_tokens: int, chunk_tokens: int) -> bool:
        """Whether a prompt after the first pass is computed in the same forward as the job
        placed before it: it joins that batch within the chunk the batch was opened with (the
        instance takes a batch whole, with the chunk of the moment its first job is taken)."""
        opened = self.batch_chunk.get(instance_id, 0)
        return self.joins_batch(instance_id, prompt_tokens, min(chunk_tokens, opened))

    def record(self, request_id: str, prefill_id: str, decode_id: str, prompt_tokens: int,
               first_pass: bool, chunk_tokens: int = 0) -> None:
        """A request of the burst was placed (its prefill in the first pass or after it, in
        passes of `chunk_tokens`; 0: not known)."""
        self.ids.add(request_id)
        if not first_pass and chunk_tokens:
            joined = self.joins_batch(prefill_id, prompt_tokens, chunk_tokens)
            held = self.batch.get(prefill_id, 0) if joined else 0
            self.batch[prefill_id] = held + prompt_tokens
            if not joined:
                self.batch_chunk[prefill_id] = chunk_tokens
        self.context[decode_id] = self.context.get(decode_id, 0) + prompt_tokens
        for iid in (prefill_id, decode_id):
            self.placed[iid] = self.placed.get(iid, 0) + 1
        if first_pass:
            self.first_pass[prefill_id] = self.first_pass.get(prefill_id, 0) + prompt_tokens
        else:
            self.full.add(prefill_id)


def settle(plans: list[Plan | None]) -> list[Plan | None]:
    """The burst's plans with ranks per prefill instance, their first passes' sizes, and each
    first-pass member's TTFT estimate and start deadline those of the whole pass."""
    by_instance: dict[str, list[int]] = {}
    for i, plan in enumerate(plans):
        if plan is not None and plan.order is not None:
            by_instance.setdefault(plan.prefill.instance_id, []).append(i)
    out = list(plans)
    for members in by_instance.values():
        firsts = [i for i in members if _plan(out, i).first_pass]
        pass_ranks = len(firsts) if len(firsts) > 1 else 0
        # When the pass ends, counted from placement (each member's own wait comes on top).
        end = max((_since_placed(_plan(out, i).prefill_estimate) for i in firsts), default=0.0)
        start = min((_plan(out, i).prefill_estimate.queue_s for i in firsts), default=0.0)
        for rank, i in enumerate(members):
            plan = _plan(out, i)
            assert plan.order is not None
            order = Order(plan.order.burst_at, rank,
                          pass_ranks if rank < pass_ranks else 0)
            if plan.first_pass and pass_ranks:
                waited = plan.prefill_estimate.waited_s
                est = plan.prefill_estimate._replace(ttft_s=end + waited)
                start_by = plan.start_by
                if start_by is not None:
                    # The pass starts once, for all of them: early enough for the whole pass.
                    own = _since_placed(plan.prefill_estimate) - plan.prefill_estimate.queue_s
                    start_by += own - (end - start)
                out[i] = plan._replace(order=order, prefill_estimate=est, start_by=start_by)
            else:
                out[i] = plan._replace(order=order)
        for batch in _batches(out, [i for i in members if not _plan(out, i).first_pass]):
            # One forward computes them all: each answers when it ends, as the last of them.
            end = max(_since_placed(_plan(out, i).prefill_estimate) for i in batch)
            for i in batch:
                plan = _plan(out, i)
                est = plan.prefill_estimate
                out[i] = plan._replace(prefill_estimate=est._replace(ttft_s=end + est.waited_s))
    return out


def _batches(plans: list[Plan | None], after_pass: list[int]) -> list[list[int]]:
    """The runs of two or more plans after a first pass that one forward computes together."""
    runs: list[list[int]] = []
    for i in after_pass:
        if runs and _plan(plans, i).batched:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [run for run in runs if len(run) > 1]


def _since_placed(est: PrefillEstimate) -> float:
    """Its TTFT estimate less the wait before it was placed."""
    return est.ttft_s - est.waited_s


def _plan(plans: list[Plan | None], i: int) -> Plan:
    plan = plans[i]
    assert plan is not None
    return plan
