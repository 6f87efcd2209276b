"""Request size limits of the public API: what a single request may ask of the server.

The body size is enforced on the raw stream by `api.security.ApiGuard` (413); the rest are checked
here, on the parsed request, before any tokenizing or engine work starts (400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake_server.api.errors import APIError
from mooncake_server.api.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from mooncake_server.config import ServerConfig


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits; None for a token limit means the context window decides."""

    max_body_bytes: int = 8 << 20
    max_messages: int = 2048
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_stop_sequences: int = 4
    max_stop_chars: int = 256
    max_n: int = 8  # choices per request (each decodes on its own; the prompt is shared)

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        """The limits a role's flags set."""
        return cls(
            max_body_bytes=config.max_request_bytes,
            max_messages=config.max_messages,
            max_prompt_tokens=config.max_prompt_tokens,
            max_tokens=config.max_tokens_limit,
            max_stop_sequences=config.max_stop_sequences,
            max_stop_chars=config.max_stop_chars,
            max_n=config.max_n,
        )

    def check_request(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        """Message count, stop sequences and max_tokens; cheap, so before tokenizing."""
        if isinstance(body, ChatCompletionRequest) and len(body.messages) > self.max_messages:
            raise APIError(
                f"messages: at most {self.max_messages} messages per request, got "
                f"{len(body.messages)}", param="messages", code="array_above_max_length")
        if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo: the prompt scored, "
                           "nothing generated)", param="max_tokens", code="invalid_value")
        if (body.n or 1) > self.max_n:
            raise APIError(f"n: at most {self.max_n} choices per request, got {body.n}",
                           param="n", code="invalid_value")
        stops = body.stop_list()
        if len(stops) > self.max_stop_sequences:
            raise APIError(
                f"stop: at most {self.max_stop_sequences} stop sequences, got {len(stops)}",
                param="stop", code="array_above_max_length")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_chars:
            raise APIError(
                f"stop: each stop sequence may have at most {self.max_stop_chars} characters, "
                f"got one of {longest}", param="stop", code="string_above_max_length")
        requested = body.requested_max_tokens()
        if self.max_tokens is not None and requested is not None and requested > self.max_tokens:
            param = ("max_completion_tokens" if isinstance(body, ChatCompletionRequest)
                     and body.max_completion_tokens else "max_tokens")
            raise APIError(
                f"{param} is too large: {requested}. This server allows at most "
                f"{self.max_tokens} completion tokens per request.", param=param,
                code="invalid_value")

    def check_prompt(self, prompt_tokens: int, what: str) -> None:
        """The prompt's token count (after the chat template)."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise APIError(
                f"{what}: the prompt has {prompt_tokens} tokens; this server accepts at most "
                f"{self.max_prompt_tokens} prompt tokens per request", param=what,
                code="context_length_exceeded")

    def default_max_tokens(self, room: int) -> int:
        """max_tokens of a request that gave none: fill the context, up to the limit."""
        return room if self.max_tokens is None else min(room, self.max_tokens)
