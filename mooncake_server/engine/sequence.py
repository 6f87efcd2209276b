"""Request state inside an engine: tokens, KV blocks, sampling, status."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import torch

from mooncake_server.engine.sampler import LogitRules
from mooncake_server.wire.jobs import SamplingParams


class SeqStatus(enum.Enum):
    """Where a sequence is in the engine loop."""

    WAITING = "waiting"  # admitted, KV not allocated yet
    RUNNING = "running"  # in the continuous batch
    FINISHED = "finished"  # EOS / length / cancelled / failed; blocks freed


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
    # Tokens the engine produced for this sequence, delivered on the event loop.
    events: asyncio.Queue[tuple[int, str | None, int] | None] = field(default_factory=asyncio.Queue)
    generator: torch.Generator | None = None
    logit_rules: LogitRules | None = None  # None = the model's logits are sampled as they are

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
    def num_generated(self) -> int:
        """Output tokens so far (including one produced by a remote prefill)."""
        return len(self.token_ids) - self.prompt_len

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
