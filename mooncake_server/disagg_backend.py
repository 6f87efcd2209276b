"""The conductor's `Backend`: a request crosses a prefill instance, the store and a decode instance.

A request walks, in order:
  block keys computed -> placed (home store node = longest cached prefix per the global store
  index, else round-robin; prefill, decode picked among live instances) ->
  prefilling (POST /internal/prefill; the prompt's KV lands in the store) -> first token yielded ->
  decoding (POST /internal/decode, NDJSON stream of tokens 2..N) -> finished.
A request that ends before the decode instance took it over (EOS or max_tokens at the first
token, the caller closing the iterator, an error) removes its partial tail block from the store;
closing the iterator while decoding closes the HTTP stream, which the decode instance sees as a
disconnect and frees the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import httpx
from pydantic import ValidationError

from mooncake_server.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.block_keys import block_keys, kv_namespace
from mooncake_server.config import ServerConfig
from mooncake_server.internal_http import secret_headers
from mooncake_server.messages import (
    DecodeEvent,
    DecodeJob,
    ErrorEvent,
    InstanceInfo,
    PrefillJob,
    PrefillResult,
    StoreKeys,
    StoreLocation,
)
from mooncake_server.model_assets import served_name
from mooncake_server.registry import InstanceRegistry
from mooncake_server.store.master import StoreMaster

log = logging.getLogger(__name__)

# Hashing this many tokens takes ~10 ms: above it, do it off the event loop.
_KEYS_IN_THREAD_ABOVE = 100_000


class Placement(NamedTuple):
    """Where one request runs."""

    store: InstanceInfo
    prefill: InstanceInfo
    decode: InstanceInfo


class InstancePicker(Protocol):
    """Chooses instances for a request (the KVCache-aware scheduler replaces round-robin)."""

    def pick_store(self, request: GenerateRequest, keys: Sequence[str]) -> InstanceInfo | None:
        """The store node that receives the prompt's blocks; None if none is available."""
        ...

    def pick_prefill(self, request: GenerateRequest, keys: Sequence[str]) -> InstanceInfo | None:
        """The prefill instance; None if none is available."""
        ...

    def pick_decode(self, request: GenerateRequest) -> InstanceInfo | None:
        """The decode instance; None if none is available."""
        ...


class RoundRobinPicker:
    """Round-robin among live instances of each role."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self._registry = registry

    def pick_store(self, request: GenerateRequest, keys: Sequence[str]) -> InstanceInfo | None:
        """Next live store node."""
        return self._registry.pick("store")

    def pick_prefill(self, request: GenerateRequest, keys: Sequence[str]) -> InstanceInfo | None:
        """Next live prefill instance."""
        return self._registry.pick("prefill")

    def pick_decode(self, request: GenerateRequest) -> InstanceInfo | None:
        """Next live decode instance."""
        return self._registry.pick("decode")


@dataclass
class _Flow:
    """Per-request state of one generate() call."""

    request: GenerateRequest
    keys: list[str]
    placement: Placement
    store: StoreLocation
    result: PrefillResult | None = None
    tail_settled: bool = False  # the decode instance took the tail block, or we removed it


def _peer_status(status: int) -> int:
    """HTTP status the client sees for a peer's failure status."""
    if status in (429, 503) or (400 <= status < 500 and status not in (401, 403, 404, 405)):
        return status  # overload or a problem with the request itself: pass it on
    return 502  # a peer misbehaving or misconfigured is a bad gateway from the client's view


def _peer_message(response: httpx.Response) -> str:
    """The error message in a peer's error body (FastAPI detail, OpenAI error, or text)."""
    try:
        body: Any = response.json()
    except ValueError:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
    return json.dumps(body)[:500]


class DisaggregatedBackend:
    """Backend that runs each request on a prefill instance, the store and a decode instance."""

    def __init__(
        self,
        config: ServerConfig,
        registry: InstanceRegistry,
        http: httpx.AsyncClient,
        picker: InstancePicker | None = None,
        store_master: StoreMaster | None = None,
    ) -> None:
        self._config = config
        self._registry = registry
        self._http = http
        self._picker = picker or RoundRobinPicker(registry)
        # The global store index; the conductor passes the one its /internal/store routes feed.
        self.store_master = store_master or StoreMaster(
            registry, config.store_replicas, config.cluster_secret)
        self._copy_tasks: set[asyncio.Task[int]] = set()
        self._headers = secret_headers(config.cluster_secret)
        self.namespace = kv_namespace(
            served_name(config.model, config.served_model_name), config.dtype, config.block_tokens
        )
        self._timeout = httpx.Timeout(config.request_timeout_s, connect=5.0)

    def ready(self) -> bool:
        """True when at least one prefill, decode and store instance is alive."""
        return all(self._registry.alive(role) for role in ("prefill", "decode", "store"))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Prefill, then stream the decode instance's tokens."""
        flow = await self._place(request)
        try:
            flow.result = await self._prefill(flow)
            first = flow.result.first_token
            sampling = request.sampling
            finish = None
            if first in sampling.eos_token_ids and not sampling.ignore_eos:
                finish = "stop"
            elif sampling.max_tokens == 1:
                finish = "length"
            cached = flow.result.cached_tokens
            if finish is not None:
                await self._remove_tail(flow)
                yield TokenEvent(first, finish, cached_tokens=cached)
                return
            yield TokenEvent(first, None, cached_tokens=cached)
            # NOTE: aclosing, so closing this generator closes the decode stream now, not at GC.
            async with aclosing(self._decode(flow)) as events:
                async for event in events:
                    yield event
        finally:
            if flow.result is not None and not flow.tail_settled:
                await self._remove_tail(flow)

    async def _place(self, request: GenerateRequest) -> _Flow:
        ids = request.prompt_token_ids
        bt, ns = self._config.block_tokens, self.namespace
        if len(ids) > _KEYS_IN_THREAD_ABOVE:
            keys = await asyncio.to_thread(block_keys, ids, bt, ns)
        else:
            keys = block_keys(ids, bt, ns)
        store = self._pick_store(request, keys)
        if store is None:
            raise BackendError("no store instance available", 503)
        prefill = self._picker.pick_prefill(request, keys)
        if prefill is None:
            raise BackendError("no prefill instance available", 503)
        decode = self._picker.pick_decode(request)
        if decode is None:
            raise BackendError("no decode instance available", 503)
        if store.transfer_address is None or store.segment is None:
            raise BackendError(
                f"store instance {store.instance_id} registered without a transfer address", 503)
        location = StoreLocation(instance_id=store.instance_id, url=store.url,
                                 transfer_address=store.transfer_address, segment=store.segment)
        return _Flow(request, keys, Placement(store, prefill, decode), location)

    def _pick_store(self, request: GenerateRequest, keys: list[str]) -> InstanceInfo | None:
        """The picker's store node; the round-robin picker defers to the node holding the
        longest cached prefix (one index query, which also counts hits for hot blocks).

        The job names it as the request's home node; blocks themselves live on their ring
        targets and are found through the index. Hot cached blocks gain replicas meanwhile.
        """
        master = self.store_master
        prefix = master.prefix(keys) if keys else None
        if prefix is not None and prefix.prefix:
            master.note_hits(keys[:prefix.prefix])
            self._spawn_hot_copies(keys[:prefix.prefix])
            best = max(prefix.by_node.items(), key=lambda kv: (kv[1], kv[0]), default=None)
            if isinstance(self._picker, RoundRobinPicker) and best is not None and best[1] > 0:
                info = self._registry.get(best[0])
                if info is not None:
                    return info
        return self._picker.pick_store(request, keys)

    def _spawn_hot_copies(self, keys: list[str]) -> None:
        if not self.store_master.hot_plan(keys):
            return
        task = asyncio.create_task(self.store_master.replicate_hot(keys, self._http))
        self._copy_tasks.add(task)
        task.add_done_callback(self._copy_tasks.discard)

    async def _prefill(self, flow: _Flow) -> PrefillResult:
        prefill = flow.placement.prefill
        job = PrefillJob(request_id=flow.request.request_id,
                         prompt_token_ids=flow.request.prompt_token_ids, block_keys=flow.keys,
                         sampling=flow.request.sampling, store=flow.store)
        try:
            response = await self._http.post(
                f"{prefill.url}/internal/prefill", content=job.model_dump_json(),
                headers={**self._headers, "content-type": "application/json"},
                timeout=self._timeout)
        except httpx.TransportError as exc:
            self._registry.mark_down(prefill.instance_id)
            raise BackendError(
                f"prefill instance {prefill.instance_id} unreachable: {exc!r}", 503) from exc
        if not response.is_success:
            raise BackendError(
                f"prefill instance {prefill.instance_id} failed: {_peer_message(response)}",
                _peer_status(response.status_code))
        try:
            return PrefillResult.model_validate_json(response.content)
        except ValidationError as exc:
            raise BackendError(
                f"prefill instance {prefill.instance_id} sent an invalid result", 502) from exc

    async def _decode(self, flow: _Flow) -> AsyncGenerator[TokenEvent, None]:
        decode = flow.placement.decode
        result = flow.result
        if result is None:
            raise RuntimeError("decode before prefill")  # NOTE: a bug in this module
        job = DecodeJob(request_id=flow.request.request_id,
                        prompt_token_ids=flow.request.prompt_token_ids,
                        first_token=result.first_token, block_keys=flow.keys,
                        tail_key=result.tail_key, block_checksums=result.block_checksums,
                        sampling=flow.request.sampling, store=flow.store)
        where = f"decode instance {decode.instance_id}"
        try:
            async with self._http.stream(
                "POST", f"{decode.url}/internal/decode", content=job.model_dump_json(),
                headers={**self._headers, "content-type": "application/json"},
                timeout=self._timeout,
            ) as response:
                if not response.is_success:
                    await response.aread()
                    raise BackendError(f"{where} failed: {_peer_message(response)}",
                                       _peer_status(response.status_code))
                flow.tail_settled = True  # decode accepted the job: its tail is decode's now
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = self._parse_line(line, where)
                    yield TokenEvent(event.token_id, event.finish_reason)
                    if event.finish_reason is not None:
                        return
        except httpx.TransportError as exc:
            self._registry.mark_down(decode.instance_id)
            raise BackendError(f"{where} failed mid-stream: {exc!r}", 503) from exc
        raise BackendError(f"{where} ended the stream without a final token", 502)

    @staticmethod
    def _parse_line(line: str, where: str) -> DecodeEvent:
        try:
            data = json.loads(line)
            if isinstance(data, dict) and "error" in data:
                raise BackendError(f"{where}: {ErrorEvent.model_validate(data).error}", 503)
            return DecodeEvent.model_validate(data)
        except (ValueError, ValidationError) as exc:
            raise BackendError(f"{where} sent an invalid stream line", 502) from exc

    async def _remove_tail(self, flow: _Flow) -> None:
        """Drop the request's partial tail block from every node that holds it: no decode
        instance will read it."""
        tail = flow.result.tail_key if flow.result else None
        if tail is None:
            return
        flow.tail_settled = True  # NOTE: try once, whatever the outcome
        where = self.store_master.locate([tail])
        for replica in where.replicas[0]:
            store = where.nodes[replica.node_id]
            try:
                response = await self._http.post(
                    f"{store.url}/store/remove", content=StoreKeys(keys=[tail]).model_dump_json(),
                    headers={**self._headers, "content-type": "application/json"}, timeout=5.0)
                if not response.is_success:
                    log.warning("store %s refused to remove tail %s: %s", store.instance_id,
                                tail, _peer_message(response))
            except httpx.HTTPError as exc:
                log.warning("removing tail %s from store %s failed: %r", tail,
                            store.instance_id, exc)
