"""`ScheduledBackend`: the disaggregated backend with Algorithm 1 in front of it.

A request walks: block keys -> `KVCacheScheduler.plan` (one prefix-oracle query, TTFT / TBT
estimates, maybe an immediate 429) -> the inner backend places it on the planned instances
(through the scheduler's `InstancePicker` methods) -> first token (the ledger drops its prefill) ->
tokens (its decode context grows) -> finished (the ledger forgets it). Wrapping, rather than
editing the request path, keeps the scheduler's feedback in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from mooncake_server.api.backend import Backend, GenerateRequest, TokenEvent
from mooncake_server.block_keys import block_keys
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler

# Same threshold as the request path: hashing above it leaves the event loop.
_KEYS_IN_THREAD_ABOVE = 100_000


class NamespacedBackend(Backend, Protocol):
    """A backend whose block keys live in `namespace` (DisaggregatedBackend)."""

    namespace: str


class ScheduledBackend:
    """Plans each request with the scheduler, then runs it on the inner backend."""

    def __init__(self, inner: NamespacedBackend, scheduler: KVCacheScheduler) -> None:
        self.inner = inner
        self.scheduler = scheduler

    def ready(self) -> bool:
        """As the inner backend."""
        return self.inner.ready()

    async def _keys(self, request: GenerateRequest) -> list[str]:
        ids, bt = request.prompt_token_ids, self.scheduler.block_tokens
        if len(ids) > _KEYS_IN_THREAD_ABOVE:
            return await asyncio.to_thread(block_keys, ids, bt, self.inner.namespace)
        return block_keys(ids, bt, self.inner.namespace)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Plan (raising SLORejected before any work), then stream the inner backend's tokens."""
        rid = request.request_id
        await self.scheduler.plan(request, await self._keys(request))
        try:
            first = True
            async with aclosing(self.inner.generate(request)) as events:  # type: ignore[type-var]
                async for event in events:
                    if first:
                        self.scheduler.first_token(rid)
                        first = False
                    else:
                        self.scheduler.token(rid)
                    yield event
        finally:
            self.scheduler.release(rid)
