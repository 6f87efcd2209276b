"""A `Backend` over an in-process engine loop: prefill and decode in one batch, no store hop."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.engine.loop import EngineLoop
from mooncake_server.engine.sequence import Sequence


class LocalEngineBackend:
    """The colocated baseline: the same engine loop, prompts prefilled in chunks between decodes."""

    def __init__(self, loop: EngineLoop, max_model_len: int) -> None:
        self.loop = loop
        self.max_model_len = max_model_len

    def ready(self) -> bool:
        """Always ready once built."""
        return True

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Submit the prompt and stream its tokens; closing the iterator cancels it."""
        seq = Sequence(request.request_id, list(request.prompt_token_ids),
                       len(request.prompt_token_ids), request.sampling, self.max_model_len)
        if self.loop.kv.layout.blocks_for(seq.prompt_len + 1) > self.loop.kv.num_blocks:
            raise BackendError("prompt does not fit in the KV cache", status=400)
        self.loop.submit(seq)
        try:
            while True:
                ev = await seq.events.get()
                if ev is None:
                    if seq.error:
                        raise BackendError(seq.error, status=503)
                    return
                token, reason, _ = ev
                yield TokenEvent(token_id=token, finish_reason=reason)
        finally:
            self.loop.cancel(seq)
