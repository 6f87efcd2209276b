"""Jobs the conductor sends to prefill and decode instances, and what comes back (HTTP JSON).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# What a prefill may reuse: its local cache only, local + the store, or nothing (recompute).
Reuse = Literal["local", "global", "none"]

# Added to a request's seed once per choice index: choice i of a seeded n > 1 request samples
# with its own generator, so choices differ yet the same request + seed repeats them.
_CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15
_SEED_RANGE = 2**64


class SamplingParams(BaseModel):
    """How to pick the next token; temperature 0 means greedy."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    eos_token_ids: list[int] = Field(default_factory=list)
    # Logit adjustments (engine/sampler.py LogitRules); the defaults leave the logits untouched.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    min_tokens: int = Field(default=0, ge=0)  # EOS is masked until this many tokens were produced
    # Log-probabilities (engine/logprobs.py): None = not asked, else how many top alternatives
    # go with each sampled token (`logprobs`) or each prompt token (`prompt_logprobs`, echo).
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)  # choices sharing the prompt's KV (the prompt computed once)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` alone: n = 1, the seed derived from the request's."""
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index * _CHOICE_SEED_STRIDE) % _SEED_RANGE
        return self.model_copy(update={"n": 1, "seed": seed})

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty, a bias or min_tokens changes the model's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0
                    or (self.min_tokens > 0 and self.eos_token_ids and not self.ignore_eos))


class TokenLogprob(BaseModel):
    """A token's log-probability under the model's raw distribution, with the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)  # (id, logprob), likeliest first


class FirstToken(BaseModel):
    """The first output token of one choice (sampled by the prefill)."""

    token_id: int
    logprob: TokenLogprob | None = None


# ---------------------------------------------------------------------------------------------
# Conductor -> prefill


class PrefillJob(BaseModel):
    """Prefill this prompt: reuse cached prefix blocks, compute the rest, store new blocks."""

    request_id: str
    prompt_token_ids: list[int]
    block_keys: list[str]  # chained keys of the prompt's full blocks
    sampling: SamplingParams
    # Which cached prefix the instance may reuse (the conductor's policy decides):
    # "local" = only blocks in its own paged pool, "global" = also fetch the rest of the cached
    # prefix from the store, "none" = compute every token.
    reuse: Reuse = "global"
    # Its place in the instance's queue, decided by the conductor's burst admission: the
    # burst's wall-clock time, then its rank in the burst (None: in order of arrival).
    burst_at: float | None = None
    burst_rank: int = 0  # among the burst's jobs sent to this instance
    # Ranks 0..burst_pass-1 run in one pass: the instance waits for all of them (0: no such pass).
    burst_pass: int = Field(default=0, ge=0)
    # Start it within this many seconds of its arrival or turn it away (429): later, it would
    # miss its TTFT SLO. None: no deadline.
    start_within_s: float | None = None
    # Its first token is due within this many seconds of its arrival (its TTFT SLO): a burst's
    # first pass that runs late answers the jobs it has computed instead of holding them for
    # its end. None: no deadline.
    answer_within_s: float | None = None
    # ... and estimated within this many (the conductor's TTFT estimate): the instance packs
    # no job into a forward that would end well past a member's (job_queue.py). None: none.
    expect_within_s: float | None = None
    # The last rank of its burst's first pass, the prompt that took the pass past one chunk:
    # it gets a forward of its own after the others', started only if it would end by
    # `answer_within_s` at the speed they ran; otherwise it is turned away (429) before any work.
    pass_tail: bool = False


class PrefillFirst(BaseModel):
    """A prefill's first output tokens, sent the moment its prompt is computed: the client
    streams them while the prompt's KV is still being written to the store."""

    first_token: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the store instead of compute
    first_logprob: TokenLogprob | None = None  # with sampling.logprobs
    # With sampling.prompt_logprobs (echo): one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    other_choices: list[FirstToken] = Field(default_factory=list)  # choices 1..n-1


class PrefillResult(PrefillFirst):
    """Outcome of a prefill: its first tokens (what its first line carried) and where the
    prompt's KV now lives."""

    request_id: str
    tail_key: str | None  # store key of the partial last block (None if the prompt fills blocks)
    block_checksums: list[int]  # CRC32C of each full block, then the tail, in key order
    prefill_seconds: float
    local_cached_tokens: int = 0  # of cached_tokens, those found in the instance's own cache
    # Seconds the result waited after the first tokens went out while prompts queued behind it
    # ran whole (roles/prefill/hand_on.py): the hand-off to the decode starts only now.
    held_s: float = Field(default=0.0, ge=0.0)


class PrefillCacheReport(BaseModel):
    """A prefill instance's local prefix cache: changes since its last report, or everything."""

    instance_id: str
    epoch: str  # new each time the instance starts: its old state is void
    seq: int = Field(ge=0)
    snapshot: bool = False
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)


class PrefillCacheReportReply(BaseModel):
    """resync = the conductor does not know this epoch (or missed a report): send a snapshot."""

    accepted: bool
    resync: bool = False


# ---------------------------------------------------------------------------------------------
# Conductor -> decode


class DecodeJob(BaseModel):
    """Load the prompt's KV from the store and decode, streaming tokens back."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    block_keys: list[str]
    tail_key: str | None
    block_checksums: list[int]
    sampling: SamplingParams
    # A moved request (migration): output tokens after `first_token` the client already has;
    # `block_keys` then names every full block of the computed tokens, not only the prompt's.
    generated_token_ids: list[int] = Field(default_factory=list)
    # Namespace of the chained keys, so the decode instance can key the blocks it writes back.
    kv_namespace: str | None = None
    # False when other choices of the request read the same tail (n > 1): the conductor drops it.
    drop_tail: bool = True


class DecodeReserve(BaseModel):
    """Ask a decode instance, before prefill starts, to hold room for a request (admission)."""

    request_id: str
    prompt_tokens: int = Field(ge=0)
    max_tokens: int = Field(ge=1)


class DecodeReserveReply(BaseModel):
    """The request is admitted; its decode job must arrive within `ttl_s`."""

    ttl_s: float


class DecodeRelease(BaseModel):
    """Drop a reservation whose decode job will not come (the request ended at prefill)."""

    request_id: str


class DecodeEvent(BaseModel):
    """One line of the decode stream (NDJSON): a token, and the reason if it is the last."""

    token_id: int
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    batch_size: int = 1  # size of the forward pass that produced it
    # Position of the token in the output (the prefill's first token is 0): the conductor drops
    # a token it already passed on, so a moved request never repeats one.
    index: int | None = None
    logprob: TokenLogprob | None = None  # with sampling.logprobs


class ErrorEvent(BaseModel):
    """A decode stream line reporting a failure instead of a token."""

    error: str
