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
Faults (disagg_moves.py, failover.py): a prefill job whose instance dies, stalls or fails it is
re-sent to another prefill instance; a decoding request whose instance dies, stalls or fails it,
or that an operator moves (POST /internal/migrate), goes on on another decode instance from the
tokens the client already has, none repeated.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Protocol

import httpx
from pydantic import ValidationError

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.block_keys import block_keys, kv_namespace
from mooncake_server.config import ServerConfig
from mooncake_server.model_assets import served_name
from mooncake_server.roles.conductor.admission_client import release_decode_later, reserve_decode
from mooncake_server.roles.conductor.failover import (
    DIED,
    ERROR,
    REFUSED,
    FailoverStats,
    InstanceLost,
    LineFeed,
    check_interval,
)
from mooncake_server.roles.conductor.moves import RequestMoves
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.store_index.master import StoreMaster
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.instances import InstanceInfo, StoreLocation
from mooncake_server.wire.jobs import (
    DecodeEvent,
    DecodeJob,
    ErrorEvent,
    PrefillJob,
    PrefillResult,
    Reuse,
)
from mooncake_server.wire.store_ops import StoreKeys

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
    reserved_on: InstanceInfo | None = None  # decode instance holding room, until its job starts
    # Failover (failover.py): output after the first token already passed on, moves so far,
    # an ordered move and its target, decode instances that refused the request.
    phase: str = "prefill"
    delivered: list[int] = field(default_factory=list)
    moves: int = 0
    move: asyncio.Event = field(default_factory=asyncio.Event)
    move_target: str | None = None
    refused: set[str] = field(default_factory=set)


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


class DisaggregatedBackend(RequestMoves):
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
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._headers = secret_headers(config.cluster_secret)
        self.namespace = kv_namespace(
            served_name(config.model, config.served_model_name), config.dtype, config.block_tokens
        )
        self._timeout = httpx.Timeout(config.request_timeout_s, connect=5.0)
        self.failover = FailoverStats()
        self._flows: dict[str, _Flow] = {}
        self._check_s = check_interval(config.heartbeat_timeout_s)

    def ready(self) -> bool:
        """True when at least one prefill, decode and store instance is alive."""
        return all(self._registry.alive(role) for role in ("prefill", "decode", "store"))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Prefill, then stream the decode instance's tokens."""
        flow = await self._place(request)
        await self._reserve_decode(flow)
        try:
            self._flows[request.request_id] = flow
            flow.result = await self._prefill_resending(flow)
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
            self._flows.pop(request.request_id, None)
            if flow.reserved_on is not None:
                release_decode_later(self._http, self._headers, flow.reserved_on,
                                     request.request_id, self._release_tasks)
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
        location = StoreLocation.of(store)
        if location is None:
            raise BackendError(
                f"store instance {store.instance_id} registered without a transfer address", 503)
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

    async def _reserve_decode(self, flow: _Flow) -> None:
        """Decode admission before any prefill work: the planned decode instance (or the next
        one the picker offers) holds room for the request; SLORejected (429) if none will."""
        if flow.request.sampling.max_tokens <= 1:
            return  # the first token, from prefill, is the last one
        decode = await reserve_decode(self._http, self._headers, flow.request,
                                      flow.placement.decode, self._registry,
                                      getattr(self._picker, "repick_decode", None))
        flow.placement = flow.placement._replace(decode=decode)
        flow.reserved_on = decode

    def _prefill_reuse(self, request: GenerateRequest) -> Reuse:
        """What the prefill may reuse (`PrefillJob.reuse`): the picker's call, else everything."""
        reuse = getattr(self._picker, "prefill_reuse", None)
        return reuse(request) if reuse is not None else "global"

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
                         sampling=flow.request.sampling, store=flow.store,
                         reuse=self._prefill_reuse(flow.request))
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

    async def _decode_on(self, flow: _Flow, decode: InstanceInfo,
                         job: DecodeJob) -> AsyncGenerator[TokenEvent, None]:
        """One decode instance's stream; InstanceLost / MoveOrdered end it early."""
        where = f"decode instance {decode.instance_id}"
        alive = partial(self._registry.is_alive, decode.instance_id)
        feed = LineFeed(partial(self._read_decode, flow, decode, job))
        try:
            while (line := await feed.next(alive, flow.move, self._check_s)) is not None:
                event = self._next_event(flow, line, where)
                if event is None:
                    continue
                flow.delivered.append(event.token_id)
                yield TokenEvent(event.token_id, event.finish_reason)
                if event.finish_reason is not None:
                    return
        finally:
            await feed.aclose()
        raise InstanceLost(f"{where} ended the stream without a final token", DIED, False)

    async def _read_decode(self, flow: _Flow, decode: InstanceInfo, job: DecodeJob,
                           emit: Callable[[str], None]) -> None:
        """POST the job and emit the stream's lines (runs in the LineFeed's own task)."""
        where = f"decode instance {decode.instance_id}"
        try:
            async with self._http.stream(
                "POST", f"{decode.url}/internal/decode", content=job.model_dump_json(),
                headers={**self._headers, "content-type": "application/json"},
                timeout=self._timeout,
            ) as response:
                if not response.is_success:
                    await response.aread()
                    if response.status_code == 503:
                        raise InstanceLost(f"{where} refused: {_peer_message(response)}",
                                           REFUSED, False)
                    raise BackendError(f"{where} failed: {_peer_message(response)}",
                                       _peer_status(response.status_code))
                flow.tail_settled = True  # decode accepted the job: its tail is decode's now
                flow.reserved_on = None  # and the job claimed the reservation
                async for line in response.aiter_lines():
                    emit(line)
        except httpx.TransportError as exc:
            raise InstanceLost(f"{where} failed mid-stream: {exc!r}", DIED, True) from exc

    def _next_event(self, flow: _Flow, line: str, where: str) -> DecodeEvent | None:
        """The stream line's token, None for a blank line or a token the client already has;
        an error line raises InstanceLost (the request moves on)."""
        if not line.strip():
            return None
        try:
            event = self._parse_line(line, where)
        except BackendError as exc:
            if exc.status != 503:
                raise
            raise InstanceLost(str(exc), ERROR, False) from exc  # an error event
        expected = 1 + len(flow.delivered)
        if event.index is not None and event.index < expected:
            self.failover.duplicates_dropped += 1  # a moved request repeating itself
            return None
        if event.index is not None and event.index > expected:
            raise BackendError(f"{where} skipped output tokens {expected}..{event.index - 1}",
                               502)
        return event

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
