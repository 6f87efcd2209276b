"""One request's walk through a Backend token stream: text deltas, stop strings, accounting.

Lifecycle: created right after backend.generate() (counts as running) -> first TokenEvent
received into `pending` (so early failures become HTTP errors) -> `advance()` until
`finish_reason` is set -> `close()` (always; idempotent), which closes the backend iterator so
the backend frees the request's resources -> `report(status)` once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from mooncake_server.api.backend import TokenEvent
from mooncake_server.api.detokenizer import IncrementalDetokenizer
from mooncake_server.api.metrics import ApiMetrics


@dataclass
class Generation:
    """Per-request state between the backend iterator and the response being written."""

    request_id: str
    endpoint: str
    prompt_tokens: int
    max_tokens: int
    events: AsyncIterator[TokenEvent]
    detok: IncrementalDetokenizer
    metrics: ApiMetrics
    arrival: float  # time.perf_counter() when the request arrived
    pending: TokenEvent | None = None  # the already-received first event
    prompt_token_ids: list[int] = field(default_factory=list)
    return_token_ids: bool = False  # the client asked for token ids in the reply
    token_ids: list[int] = field(default_factory=list)  # every generated id, EOS included
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    _last_token_at: float = 0.0
    _ids_sent: int = 0
    _closed: bool = False
    _reported: bool = False

    def __post_init__(self) -> None:
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def report(self, status: int | str) -> None:
        """Count the request's outcome once (later calls are ignored)."""
        if not self._reported:
            self._reported = True
            self.metrics.count(self.endpoint, status)

    async def advance(self) -> str:
        """Consume one token event and return the text it releases (maybe empty).

        Sets `finish_reason` once the generation is over ("stop": EOS or a stop string,
        "length": max_tokens); then the returned text includes everything held back.
        """
        if self.pending is not None:
            event, self.pending = self.pending, None
        else:
            try:
                event = await anext(self.events)
            except StopAsyncIteration:
                # The backend ended without marking its last token; infer the reason.
                over = self.completion_tokens >= self.max_tokens
                self.finish_reason = "length" if over else "stop"
                return self._flush()
        self._observe(event)
        text = self.detok.add(event.token_id)
        if self.detok.stopped:
            self.finish_reason = "stop"
            await self.close()  # cancel the backend request now, not when the client is done
            return text
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            return text + self._flush()
        if self.completion_tokens >= self.max_tokens:
            # NOTE: the backend owns the limit; this guards against one that overshoots.
            self.finish_reason = "length"
            await self.close()
            return text + self._flush()
        return text

    def take_new_ids(self) -> list[int] | None:
        """Token ids not yet sent in a stream chunk (None unless return_token_ids)."""
        if not self.return_token_ids:
            return None
        new = self.token_ids[self._ids_sent :]
        self._ids_sent = len(self.token_ids)
        return new

    def _flush(self) -> str:
        tail = self.detok.finish()
        if self.detok.stopped:
            self.finish_reason = "stop"
        return tail

    def _observe(self, event: TokenEvent) -> None:
        now = time.perf_counter()
        if self.completion_tokens == 0:
            self.cached_tokens = event.cached_tokens
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.cached_prompt_tokens.inc(event.cached_tokens)
        else:
            self.metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now
        self.token_ids.append(event.token_id)
        self.completion_tokens += 1
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
