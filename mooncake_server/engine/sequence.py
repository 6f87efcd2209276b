"""Request state inside an engine: tokens, KV blocks, sampling, status."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mooncake_server.engine.sampler import LogitRules
from mooncake_server.wire.jobs import SamplingParams, TokenLogprob


class SeqStatus(enum.Enum):
    """Where a sequence is in the engine loop."""

    WAITING = "waiting"  # admitted, KV not allocated yet
    RUNNING = "running"  # in the continuous batch
    FINISHED = "finished"  # EOS / length / cancelled / failed; blocks freed


class Produced(NamedTuple):
    """A token the engine produced for a sequence (what its `events` queue carries)."""

    token_id: int
    finish_reason: str | None
    batch_size: int  # size of the forward pass that produced it
    logprob: TokenLogprob | None = None  # with sampling.logprobs
    choice: int = 0  # which of the request's n choices (queues shared by siblings)


LATE_FOR_SLO = "its prompt could not start in time to meet the TTFT SLO"


@dataclass
class Sequence:
    """One request's tokens and cache state.

    `token_ids` = prompt + generated. The KV of `token_ids[:num_computed]` is in the cache; the
    next forward computes `token_ids[num_computed:]` (a prefill chunk, or the one newest token).
    """

    request_id: str
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    max_model_len: int
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    # Tokens the engine produced for this sequence, delivered on the event loop; None once it
    # finished. Sibling choices of one request share one queue (Produced.choice tells them apart).
    events: asyncio.Queue[Produced | None] = field(default_factory=asyncio.Queue)
    generator: torch.Generator | None = None
    logit_rules: LogitRules | None = None  # None = the model's logits are sampled as they are
    # Prompt scoring (echo): set to [None] (the first token has no score) by whoever wants the
    # prompt's log-probabilities; the engine appends one entry per prompt token it computes.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    choice: int = 0
    # n > 1: the other choices, forked from this one once its prompt is computed (engine/loop.py)
    forks: list[Sequence] = field(default_factory=list)
    shared_blocks: int = 0  # leading block_ids shared with sibling choices (ref-counted)
    # With a TTFT SLO: the perf_counter() by which its prompt must start computing; a sequence
    # still waiting then ends with LATE_FOR_SLO before any work (the API answers 429).
    start_by: float | None = None

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)
        if self.sampling.adjusts_logits:
            self.logit_rules = LogitRules(self.sampling, self.token_ids, self.prompt_len)

    def next_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] after this request's penalties, bias and min_tokens (as is if none)."""
        if self.logit_rules is None:
            return logits
        return self.logit_rules.apply(logits, self.token_ids)

    @property
    def scores_prompt(self) -> bool:
        """True while prompt chunks still to compute need every row's logits (echo)."""
        return self.prompt_logprobs is not None and self.num_computed < self.prompt_len

    @property
    def num_generated(self) -> int:
        """Output tokens so far (including one produced by a remote prefill)."""
        return len(self.token_ids) - self.prompt_len

    @property
    def decoding(self) -> bool:
        """Its prompt is computed and its next pass computes just its newest token. A
        one-token prompt not yet computed is not decoding, though it too has one token pending."""
        return self.num_pending == 1 and self.num_computed >= self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed."""
        return len(self.token_ids) - self.num_computed

    def finish_reason_after(self, token: int) -> str | None:
        """Why generation stops after `token` was appended, or None to continue."""
        if token in self.sampling.eos_token_ids and not self.sampling.ignore_eos:
            return "stop"
        if self.num_generated >= self.sampling.max_tokens:
            return "length"
        if len(self.token_ids) >= self.max_model_len:
            return "length"
        return None
