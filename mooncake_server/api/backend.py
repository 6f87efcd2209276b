"""The contract between the public API and whatever produces tokens.

The conductor's disaggregated path (prefill -> store -> decode) and the colocated engine both
implement `Backend`; the OpenAI layer in `api/` only ever talks to this interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from mooncake_server.wire.jobs import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """A tokenized request ready for generation."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `cached_tokens` is meaningful on the first event."""

    token_id: int
    finish_reason: str | None = None  # "stop" (EOS) | "length" on the last token
    cached_tokens: int = 0


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
        """Stream tokens until EOS, max_tokens, or the caller closes the iterator."""
        ...

    def ready(self) -> bool:
        """True when the backend can accept requests (enough instances registered)."""
        ...
