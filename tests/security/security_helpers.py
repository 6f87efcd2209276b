"""Helpers of the security tests: a scripted backend (live servers: `mooncake_testkit`).

A uniquely named module (not conftest) so tests import it without clashing with other folders'
conftest modules.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mooncake_server.api.backend import GenerateRequest, TokenEvent

MODEL = "test-model"
MAX_MODEL_LEN = 256


@dataclass
class EchoBackend:
    """Yields two fixed tokens; records the requests it was given."""

    requests: list[GenerateRequest] = field(default_factory=list)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Two tokens, the last one finishing the request."""
        self.requests.append(request)
        yield TokenEvent(28, None, 0)
        yield TokenEvent(29, "stop", 0)

    def ready(self) -> bool:
        """Always ready."""
        return True
