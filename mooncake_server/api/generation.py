"""One request's walk through a Backend token stream: text deltas, stop strings, accounting.

Lifecycle: created right after backend.generate() (counts as running) -> first TokenEvent
received into `pending` (so early failures become HTTP errors) -> `advance()` until every
choice has its `finish_reason` -> `close()` (always; idempotent), which closes the backend
iterator so the backend frees the request's resources -> `report(status)` once.

A request has `n` choices; the backend's events name theirs. A choice that meets a stop string
ends there; with n = 1 that closes the backend request at once, with n > 1 its later tokens are
dropped until its siblings are done too (the backend cannot cancel one choice alone).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from mooncake_server.api.backend import TokenEvent
from mooncake_server.api.detokenizer import IncrementalDetokenizer
from mooncake_server.api.metrics import ApiMetrics
from mooncake_server.wire.jobs import TokenLogprob


@dataclass
class Choice:
    """One choice's output so far."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # every generated id, EOS included
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked
    finish_reason: str | None = None
    announced: bool = False  # a stream chunk of this choice went out (chat: with its role)
    ended: bool = False  # the stream chunk with its finish reason went out
    next_offset: int = 0  # text_offset of the next token (completions' logprobs)
    _ids_sent: int = 0
    _logprobs_sent: int = 0
    _last_token_at: float = 0.0

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for this choice."""
        return len(self.token_ids)

    def take_new_ids(self) -> list[int]:
        """Token ids not yet sent in a stream chunk."""
        new = self.token_ids[self._ids_sent:]
        self._ids_sent = len(self.token_ids)
        return new

    def take_new_logprobs(self) -> list[TokenLogprob]:
        """Log-probability entries not yet sent in a stream chunk."""
        new = self.logprobs[self._logprobs_sent:]
        self._logprobs_sent = len(self.logprobs)
        return new


@dataclass
class Generation:
    """Per-request state between the backend iterator and the response being written."""

    request_id: str
    endpoint: str
    prompt_tokens: int
    max_tokens: int  # as the client asked: 0 = score the prompt only (echo), no output
    events: AsyncIterator[TokenEvent]
    choices: list[Choice]
    metrics: ApiMetrics
    arrival: float  # time.perf_counter() when the request arrived
    pending: TokenEvent | None = None  # the already-received first event
    prompt_token_ids: list[int] = field(default_factory=list)
    return_token_ids: bool = False  # the client asked for token ids in the reply
    prompt_logprobs: list[TokenLogprob | None] | None = None  # from the first event (echo)
    echo_text: str | None = None  # completions with echo: the prompt's text, put before output
    logprobs_top: int | None = None  # alternatives per token; None = no log-probabilities
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int = 0
    _started: bool = False
    _closed: bool = False
    _reported: bool = False

    def __post_init__(self) -> None:
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason."""
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        """Output tokens of all choices together (usage counts them summed, as OpenAI does)."""
        return sum(c.completion_tokens for c in self.choices)

    def report(self, status: int | str) -> None:
        """Count the request's outcome once (later calls are ignored)."""
        if not self._reported:
            self._reported = True
            self.metrics.count(self.endpoint, status)

    async def advance(self) -> tuple[Choice, str]:
        """Consume one token event: its choice and the text it releases (maybe empty).

        Sets the choice's `finish_reason` once it is over ("stop": EOS or a stop string,
        "length": max_tokens); then the returned text includes everything held back.
        """
        if self.pending is not None:
            event, self.pending = self.pending, None
        else:
            try:
                event = await anext(self.events)
            except StopAsyncIteration:
                # The backend ended without marking the last tokens; infer the reasons.
                return self._end_all()
        choice = self.choices[event.choice]
        self._observe(event)
        if choice.finish_reason is not None:
            return choice, ""  # past a stop string (n > 1)
        if self.max_tokens == 0:  # the backend's one token only carried the prompt's scores
            choice.finish_reason = "length"
            return await self._done(choice, "")
        choice.token_ids.append(event.token_id)
        if event.logprob is not None:
            choice.logprobs.append(event.logprob)
        self._count_token(choice)
        text = choice.detok.add(event.token_id)
        if choice.detok.stopped:
            choice.finish_reason = "stop"
            return await self._done(choice, text)
        if event.finish_reason:
            choice.finish_reason = event.finish_reason
            return choice, text + self._flush(choice)
        if choice.completion_tokens >= self.max_tokens:
            # NOTE: the backend owns the limit; this guards against one that overshoots.
            choice.finish_reason = "length"
            return await self._done(choice, text + self._flush(choice))
        return choice, text

    async def _done(self, choice: Choice, text: str) -> tuple[Choice, str]:
        """A choice ended here: cancel the backend request now if it was the last one."""
        if self.finished:
            await self.close()
        return choice, text

    def _end_all(self) -> tuple[Choice, str]:
        for choice in self.choices:
            if choice.finish_reason is None:
                over = choice.completion_tokens >= self.max_tokens
                choice.finish_reason = "length" if over else "stop"
                return choice, self._flush(choice)
        return self.choices[0], ""

    def take_new_ids(self, choice: Choice) -> list[int] | None:
        """The choice's ids not yet sent in a stream chunk (None unless return_token_ids)."""
        return choice.take_new_ids() if self.return_token_ids else None

    @staticmethod
    def _flush(choice: Choice) -> str:
        tail = choice.detok.finish()
        if choice.detok.stopped:
            choice.finish_reason = "stop"
        return tail

    def _observe(self, event: TokenEvent) -> None:
        if not self._started:
            self._started = True
            self.cached_tokens = event.cached_tokens
            self.prompt_logprobs = event.prompt_logprobs
            self.metrics.ttft.observe(time.perf_counter() - self.arrival)
            self.metrics.cached_prompt_tokens.inc(event.cached_tokens)

    def _count_token(self, choice: Choice) -> None:
        now = time.perf_counter()
        if choice.completion_tokens > 1:
            self.metrics.itl.observe(now - choice._last_token_at)
        choice._last_token_at = now
        self.metrics.generation_tokens.inc()

    async def close(self) -> None:
        """Close the backend iterator (idempotent); survives the caller being cancelled."""
        if self._closed:
            return
        self._closed = True
        self.metrics.running.dec()
        aclose = getattr(self.events, "aclose", None)
        if aclose is None:
            return
        # NOTE: Starlette cancels a streaming response's task group when the client leaves;
        # without the shield the backend's own cleanup awaits would be cancelled too.
        with anyio.CancelScope(shield=True):
            await aclose()
