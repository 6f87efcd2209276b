"""How long a prefill pass beside a busy decode may run, and how many tokens that is.

On shared cores a decode's token gap is its own step plus the prefill pass it waited behind.
The pass gets what the TBT SLO leaves after the decode's step (`GAP_SHARE` of the SLO in all),
but never less than `MIN_PASS_SHARE` of it, so a prompt still moves beside a heavy batch; the
conductor counts that least pass in a decode's TBT estimate. A fixed half of the SLO per pass
(before) put gaps at step + 100 ms: the eleven requests of one burst measured TBT 213 ms
against a 200 ms SLO (goodput replay, x4, AVX512 EPYC).
The prefill instance sizes its passes with these (roles/prefill/chunk_budget.py), the conductor
predicts them with the same ones (scheduler/policy.py).
"""

from __future__ import annotations

import math

from mooncake_server.cost_model.perf_model import PerfModel

# A gap (decode step + one prefill pass) is kept to this share of the TBT SLO: the rest is the
# decode loop's own work between steps (sampling, streaming), which no pass can use.
GAP_SHARE = 0.75
# The least a pass gets beside a decode, as a share of the SLO.
MIN_PASS_SHARE = 0.2
# Smaller chunks re-read every weight for a few tokens each; below this a prompt crawls.
MIN_CHUNK = 16
# How long a pass's measured speed counts: it is the machine's (and its neighbours'), which
# changes slowly, and prompts may come tens of seconds apart; forgotten after 10 s, most
# prompts met a cut pass speed never measured.
SPEED_HORIZON_S = 60.0
# NOTE: the full prompt pass an engine times at start-up, with SLO flags: long enough that the
# per-pass cost weighs on it about as on a burst's passes (1.44x the built-in model at 512
# tokens, 1.37x on a 1,690-token pass of six prompts, AMD EPYC), short enough to add under a
# second to start-up.
SEED_PASS_TOKENS = 512
# NOTE: a burst's first pass runs past one chunk only once the prefill instance timed a full
# pass of at least this share of a chunk: a speed read on short passes predicted long ones
# short (on 16- and 128-token passes alone, a 3,169-token pass was estimated at 3.4 s and took
# 5.4 s). A prefill instance times such a pass at start-up (`seed_pass_tokens(long=True)`):
# with only the 512-token one, a run's first burst stopped at one chunk and refused its
# 734-token prompt, which in the pass was estimated at 3.56 s and answered at 3.75 s.
LONG_PASS_SHARE = 0.75
# A prefill that holds an answered job's hand-off to the decode while prompts queued behind it
# run whole (roles/prefill/hand_on.py) sends it on this long before its first token's deadline:
# the decode job, its KV load and a step, after the cut pass that may hold the cores (tens of
# milliseconds each on the 2-core machine); the TBT SLO the second token also has is margin.
HOLD_MARGIN_S = 0.25


def seed_pass_tokens(chunk_tokens: int, max_model_len: int, kv_tokens: int, *,
                     long: bool = False) -> int:
    """The start-up pass's prompt tokens on an engine with these limits: `SEED_PASS_TOKENS`, or
    (`long`) `LONG_PASS_SHARE` of a chunk if more; at most a chunk, half its context and half
    its KV pool."""
    wanted = max(SEED_PASS_TOKENS, math.ceil(LONG_PASS_SHARE * chunk_tokens)) if long \
        else SEED_PASS_TOKENS
    return max(1, min(wanted, chunk_tokens, max_model_len // 2, kv_tokens // 2))


def pass_budget_s(tbt_slo_s: float, decode_step_s: float) -> float:
    """Seconds a prefill pass may take beside a decode whose steps take `decode_step_s`."""
    return max(MIN_PASS_SHARE * tbt_slo_s, GAP_SHARE * tbt_slo_s - decode_step_s)


def chunk_fitting(model: PerfModel, ratio: float, budget_s: float, cap: int) -> int:
    """The largest chunk (MIN_CHUNK..cap tokens) whose modelled pass x `ratio` fits `budget_s`."""
    lo, hi = MIN_CHUNK, cap
    if model.prefill_s(lo) * ratio >= budget_s:
        return min(lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.prefill_s(mid) * ratio <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
