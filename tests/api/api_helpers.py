"""Helpers of the OpenAI API tests: a scriptable fake Backend (live servers: `mooncake_testkit`).

A uniquely named module (not conftest) so tests import it without clashing with other folders'
conftest modules.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent

MODEL = "test-model"
MAX_MODEL_LEN = 256
EOS = 2  # <|im_end|> of SmolLM2


@dataclass
class FakeBackend:
    """Yields scripted token ids; records requests and whether each stream was closed."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = "stop"
    cached_tokens: int = 0
    fail_before_first: BackendError | None = None
    fail_after: int | None = None  # raise a BackendError after this many tokens
    hang_after: int | None = None  # wait forever after this many tokens
    requests: list[GenerateRequest] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    yielded: int = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream the script."""
        self.requests.append(request)
        try:
            if self.fail_before_first is not None:
                raise self.fail_before_first
            for i, token in enumerate(self.token_ids):
                if i == self.fail_after:
                    raise BackendError("decode instance lost", 503)
                if i == self.hang_after:
                    await asyncio.Event().wait()
                last = i == len(self.token_ids) - 1
                self.yielded += 1
                yield TokenEvent(
                    token,
                    self.finish_reason if last else None,
                    self.cached_tokens if i == 0 else 0,
                )
        finally:
            self.closed.append(request.request_id)

    def ready(self) -> bool:
        """Always ready."""
        return True





async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `predicate` until true or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)
