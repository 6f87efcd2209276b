"""TTFT and TBT estimates of placing one request on one instance (paper §5, Algorithm 1).

TTFT on a prefill instance = queue time (its queued prefill estimates) + transfer time of the
cached prefix it lacks locally (bytes / bandwidth) + prefill time of the tokens nobody cached.
Fetching a remote prefix is chosen only when it is cheaper than recomputing those tokens.
TBT on a decode instance = the step time of its batch once this request joins it.
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


def reusable_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """Prefix blocks a prefill may reuse: at least one prompt token must be computed."""
    return max(0, (prompt_tokens - 1) // block_tokens)


def estimate_prefill(model: PerfModel, instance_id: str, prompt_tokens: int, *,
                     local_tokens: int, remote_tokens: int, queue_s: float,
                     calibration: float = 1.0) -> PrefillEstimate:
    """TTFT if `instance_id` serves a prompt of `prompt_tokens`.

    Args:
        local_tokens: cached prefix the instance reads without a network transfer.
        remote_tokens: cached prefix available elsewhere (the global store); 0 = local only.
        queue_s: time before the instance can start (already calibrated).
        calibration: measured / modelled prefill time on this instance.
    """
    local = min(local_tokens, prompt_tokens)
    remote = min(max(remote_tokens, local), prompt_tokens)
    stay = model.prefill_s(prompt_tokens - local, local) * calibration
    fetch_transfer = model.transfer_s(remote - local)
    fetch = fetch_transfer + model.prefill_s(prompt_tokens - remote, remote) * calibration
    if remote > local and fetch < stay:
        return PrefillEstimate(instance_id, queue_s + fetch, queue_s, fetch_transfer,
                               fetch - fetch_transfer, remote, remote - local, calibration)
    return PrefillEstimate(instance_id, queue_s + stay, queue_s, 0.0, stay, local, 0,
                           calibration)


def estimate_tbt(model: PerfModel, load: DecodeLoad, context_tokens: int) -> float:
    """Decode step time once a request attending `context_tokens` joins the batch `load`."""
    return model.decode_step_s(load.batch + 1, load.context_tokens + context_tokens)
