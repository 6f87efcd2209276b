"""TTFT and TBT estimates of placing one request on one instance (paper §5, Algorithm 1).

TTFT on a prefill instance = queue time (its queued prefill estimates) + transfer time of the
cached prefix it lacks locally (bytes / bandwidth) + prefill time of the tokens nobody cached.
Fetching a remote prefix is chosen only when it is cheaper than recomputing those tokens.
TBT on a decode instance = the step time of its batch once this request joins it.
A prefill instance that reports how its passes go (PassSplit, with --tbt-slo) is judged pass by
pass (`Passes`) instead of by the conductor's own calibration: beside a busy decode on the same
cores its prompts are cut into short passes that each wait for a decode step, so a long prompt
took two to four times its modelled time (the replay on the 2-core AMD machine) while a short
one did not, which one smoothed factor per instance cannot tell apart.
"""

from __future__ import annotations

from typing import NamedTuple

from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.roles.conductor.scheduler.load import DecodeLoad


class PrefillEstimate(NamedTuple):
    """TTFT of a request on one prefill instance, and its parts (seconds, tokens)."""

    instance_id: str
    ttft_s: float
    queue_s: float
    transfer_s: float
    compute_s: float  # calibrated prefill compute of the uncached tokens
    reused_tokens: int  # prefix tokens not recomputed (local + fetched)
    fetched_tokens: int  # of those, moved from a remote store node
    # The factor compute_s was scaled by: calibrations age, so a later read may differ.
    calibration: float = 1.0
    # compute_s came from the instance's own PassSplit: the conductor's calibration is not
    # applied to it again.
    split: bool = False
    first_pass: bool = False  # it joins its burst's first full pass (scheduler/bursts.py)
    # After it: the chunk its passes were estimated in (0: the conductor's own calibration),
    # and the wait for the cores charged before each of them.
    chunk_tokens: int = 0
    pass_wait_s: float = 0.0
    # Of ttft_s, the time it had already waited when placed (its burst gathering).
    waited_s: float = 0.0
    # Its passes are cut at a speed the instance has not timed beside a decode yet.
    cut_prior: bool = False
    # The last prompt of its burst's first pass, the one that took the pass past one chunk:
    # it runs in a forward of its own, started only if the forwards before it leave it
    # time (scheduler/bursts.py, `TAIL_SLO_SHARE`).
    pass_tail: bool = False


def reusable_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """Prefix blocks a prefill may reuse: at least one prompt token must be computed."""
    return max(0, (prompt_tokens - 1) // block_tokens)


class Passes(NamedTuple):
    """How a prompt is computed: passes of `chunk_tokens`, each the modelled time x `ratio`
    after waiting `wait_s` for the cores."""

    chunk_tokens: int
    ratio: float
    wait_s: float = 0.0
    prior: bool = False  # cut passes whose speed the instance has not timed yet
    # Whole because the decode of the burst's earlier requests waits for them (prefill/
    # hand_on.py): only while they end before those requests must go on.
    held: bool = False


def prefill_compute_s(model: PerfModel, new_tokens: int, cached_tokens: int, *,
                      calibration: float = 1.0, passes: Passes | None = None,
                      joins_pass: bool = False) -> float:
    """Prefill time of `new_tokens` after `cached_tokens`: the model x `calibration`, or with
    the instance's `passes`, pass by pass (its own ratio, and each pass's wait for the cores).

    `joins_pass`: its first pass is one that other prompts already pay for (a burst's first
    pass, or the pass of the jobs the instance batches it with): its fixed cost and its wait
    for the cores are not charged again (charged per prompt, ten 1-token prompts of a burst
    added 0.7 s to the estimates behind them).
    """
    joins = joins_pass and new_tokens > 0
    shared = model.prefill_c if joins else 0.0
    if passes is None:
        return (model.prefill_s(new_tokens, cached_tokens) - shared) * calibration
    modelled, n = model.chunked_prefill_s(new_tokens, cached_tokens, passes.chunk_tokens)
    waits = n - 1 if joins else n
    return (modelled - shared) * passes.ratio + waits * passes.wait_s


def estimate_prefill(model: PerfModel, instance_id: str, prompt_tokens: int, *,
                     local_tokens: int, remote_tokens: int, queue_s: float,
                     calibration: float = 1.0, passes: Passes | None = None,
                     joins_pass: bool = False) -> PrefillEstimate:
    """TTFT if `instance_id` serves a prompt of `prompt_tokens`.

    Args:
        local_tokens: cached prefix the instance reads without a network transfer.
        remote_tokens: cached prefix available elsewhere (the global store); 0 = local only.
        queue_s: time before the instance can start (already calibrated).
        calibration: measured / modelled prefill time on this instance.
        passes: the instance's own account of its passes; replaces `calibration` when given.
        joins_pass: it joins a pass other prompts already pay for (`prefill_compute_s`).
    """
    local = min(local_tokens, prompt_tokens)
    remote = min(max(remote_tokens, local), prompt_tokens)
    if passes is not None:
        calibration = 1.0

    def compute(new: int, cached: int) -> float:
        return prefill_compute_s(model, new, cached, calibration=calibration, passes=passes,
                                 joins_pass=joins_pass)

    stay = compute(prompt_tokens - local, local)
    fetch_transfer = model.transfer_s(remote - local)
    fetch = fetch_transfer + compute(prompt_tokens - remote, remote)
    split = passes is not None
    if remote > local and fetch < stay:
        return PrefillEstimate(instance_id, queue_s + fetch, queue_s, fetch_transfer,
                               fetch - fetch_transfer, remote, remote - local, calibration, split)
    return PrefillEstimate(instance_id, queue_s + stay, queue_s, 0.0, stay, local, 0,
                           calibration, split)


def judged_ttft_s(est: PrefillEstimate) -> float:
    """The TTFT admission holds a prompt to: its estimate, or, in cut passes whose speed its
    prefill has not timed yet behind only its burst's own cut passes, those own passes (and its
    wait in the gate).

    The work queued ahead runs in such passes too, and the speed read from full passes made a
    fresh server's estimates 1.1-1.6x what its first cut passes took: the 534-token prompt of
    a burst was refused at 5.75 s behind a 444-token one estimated at 2.65 s that took 1.76 s.
    Let in, it starts only by its start deadline (`Plan.start_by`, from those same own passes);
    the prefill refuses it with 429 otherwise, before any work.
    """
    return est.ttft_s - est.queue_s if est.cut_prior else est.ttft_s


def estimate_tbt(model: PerfModel, load: DecodeLoad, context_tokens: int) -> float:
    """Decode step time once a request attending `context_tokens` joins the batch `load`."""
    return model.decode_step_s(load.batch + 1, load.context_tokens + context_tokens)
