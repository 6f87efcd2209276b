"""The contract between the public API and whatever produces tokens.

The conductor's disaggregated path (prefill -> store -> decode) and the colocated engine both
implement `Backend`; the OpenAI layer in `api/` only ever talks to this interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from mooncake_server.wire.jobs import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class GenerateRequest:
    """A tokenized request ready for generation."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one choice. `cached_tokens` and `prompt_logprobs` are meaningful
    on the request's first event (choice 0's first token)."""

    token_id: int
    finish_reason: str | None = None  # "stop" (EOS) | "length" on the choice's last token
    cached_tokens: int = 0
    logprob: TokenLogprob | None = None  # with sampling.logprobs
    # With sampling.prompt_logprobs (echo): one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    choice: int = 0  # index of the choice among the request's sampling.n


class BackendError(Exception):
    """A failure the API layer turns into an OpenAI error body with `status`."""

    def __init__(self, message: str, status: int = 503, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (an overload that will pass)


class Backend(Protocol):
    """Produces tokens for a request; cancelling the iterator (aclose) frees its resources."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream tokens until every choice hit EOS or max_tokens, or the caller closes it.

        Each of the `sampling.n` choices' tokens come in order; choices interleave freely.
        """
        ...

    def ready(self) -> bool:
        """True when the backend can accept requests (enough instances registered)."""
        ...
