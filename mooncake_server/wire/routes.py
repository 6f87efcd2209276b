"""Every internal HTTP route, declared once: its method and path bound to its request and reply.

A client calls a route with `call` (the reply validated as the route's reply type), `send` (only
success checked: acknowledgements) or `open_stream` (NDJSON lines); a failed call raises a
`CallError`: `PeerUnreachable` (no answer came), `PeerRefused` (a non-2xx answer, with its status
and FastAPI `detail`) or `InvalidReply` (a 2xx answer that is not the reply type; also a
ValueError). A server registers its handler with `serve`, which checks that the handler takes
the route's request type, so FastAPI validates the body and the OpenAPI schema shows both types.
Paths are the wire contract: changing one breaks every peer still running the old build.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Generic, TypeVar, get_type_hints

import httpx
from fastapi import APIRouter, FastAPI
from fastapi.params import Depends
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from mooncake_server.wire.index import (
    StoreCommitted,
    StoreDrop,
    StoreDropReply,
    StoreLocate,
    StoreLocateReply,
    StorePlace,
    StorePlaceReply,
    StorePrefixReply,
    StoreReplicate,
    StoreReplicateReply,
    StoreReport,
    StoreReportReply,
)
from mooncake_server.wire.instances import (
    Deregister,
    Drain,
    Heartbeat,
    InstanceInfo,
    InstanceStatus,
)
from mooncake_server.wire.jobs import (
    DecodeEvent,
    DecodeJob,
    DecodeRelease,
    DecodeReserve,
    DecodeReserveReply,
    ErrorEvent,
    PrefillCacheReport,
    PrefillCacheReportReply,
    PrefillFirst,
    PrefillJob,
    PrefillResult,
)
from mooncake_server.wire.moves import MigrateReply, MigrateRequest, RunningRequest
from mooncake_server.wire.store_ops import (
    StoreExistsReply,
    StoreGet,
    StoreGetReply,
    StoreKeys,
    StoreOp,
    StorePutEnd,
    StorePutEndReply,
    StorePutStart,
    StorePutStartReply,
    StoreRelease,
    StoreReleaseReply,
    StoreRemoveReply,
)

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep")

_JSON = {"content-type": "application/json"}
_DETAIL_CHARS = 300


@dataclass(frozen=True)
class Route(Generic[Req, Rep]):
    """One internal endpoint: `method path`, taking `request` (None: no body), answering `reply`.

    A `stream` route answers NDJSON lines, one `reply` each (or an error line), not one body.
    """

    path: str
    request: type[Req] | None
    reply: Any  # a type form: a model, list[Model], dict[str, bool]
    method: str = "POST"
    stream: bool = False

    def url(self, base_url: str) -> str:
        """This route on the instance at `base_url`."""
        return base_url.rstrip("/") + self.path

    @cached_property
    def _adapter(self) -> TypeAdapter[Any]:
        return TypeAdapter(self.reply)

    def parse(self, raw: bytes | str, url: str = "") -> Rep:
        """A reply body (or one stream line) as the reply type; InvalidReply if it is not."""
        try:
            return self._adapter.validate_json(raw)
        except ValidationError as exc:
            where = url or self.path
            raise InvalidReply(self, where, f"{where} sent an invalid reply: "
                               f"{exc.errors(include_url=False)[:3]}") from exc


# --- conductor: registry -----------------------------------------------------------------------
REGISTER = Route("/internal/register", InstanceInfo, InstanceStatus)
HEARTBEAT = Route("/internal/heartbeat", Heartbeat, dict[str, bool])  # 404: register again
DRAIN = Route("/internal/drain", Drain, dict[str, bool])
DEREGISTER = Route("/internal/deregister", Deregister, dict[str, bool])
INSTANCES = Route("/internal/instances", None, list[InstanceStatus], method="GET")

# --- store master (--role master, or inside the conductor): global store index -----------------
INDEX_REPORT = Route("/internal/store/report", StoreReport, StoreReportReply)
INDEX_LOCATE = Route("/internal/store/locate", StoreLocate, StoreLocateReply)
INDEX_PLACE = Route("/internal/store/place", StorePlace, StorePlaceReply)
INDEX_PREFIX = Route("/internal/store/prefix", StoreKeys, StorePrefixReply)
INDEX_STATS = Route("/internal/store/index", None, dict[str, object], method="GET")
INDEX_COMMITTED = Route("/internal/store/committed", StoreCommitted, dict[str, bool])
INDEX_DROP = Route("/internal/store/drop", StoreDrop, StoreDropReply)
INDEX_REUSE = Route("/internal/store/reuse", StoreKeys, dict[str, int])

# --- conductor: prefill instances' local caches, moves -----------------------------------------
PREFILL_CACHE_REPORT = Route("/internal/prefill-cache/report", PrefillCacheReport,
                             PrefillCacheReportReply)
PREFILL_CACHE_INDEX = Route("/internal/prefill-cache/index", None, dict[str, int], method="GET")
MIGRATE = Route("/internal/migrate", MigrateRequest, MigrateReply)
REQUESTS = Route("/internal/requests", None, list[RunningRequest], method="GET")

# --- prefill and decode instances --------------------------------------------------------------
# NDJSON: a PrefillFirst line as soon as the prompt is computed, then the PrefillResult once its
# KV is in the store, or an ErrorEvent line. A lone PrefillResult is a whole answer too.
# NOTE: left to right: a result also parses as a PrefillFirst (fewer fields), so it goes first.
PrefillLine = Annotated[ErrorEvent | PrefillResult | PrefillFirst,
                        Field(union_mode="left_to_right")]
PREFILL = Route("/internal/prefill", PrefillJob, PrefillLine, stream=True)
# One DecodeEvent per line, or one ErrorEvent line ({"error": ...}) that ends the stream.
# NOTE: left to right, so a line with an "error" is an error whatever else it carries.
DecodeLine = Annotated[ErrorEvent | DecodeEvent, Field(union_mode="left_to_right")]
DECODE = Route("/internal/decode", DecodeJob, DecodeLine, stream=True)
DECODE_RESERVE = Route("/internal/decode/reserve", DecodeReserve, DecodeReserveReply)
DECODE_RELEASE = Route("/internal/decode/release", DecodeRelease, dict[str, bool])

# --- store nodes (each op also served on the node's RPC channel, wire/rpc.py) -------------------
STORE_ROUTES: Mapping[StoreOp, Route[Any, Any]] = {
    StoreOp.PUT_START: Route("/store/put_start", StorePutStart, StorePutStartReply),
    StoreOp.PUT_END: Route("/store/put_end", StorePutEnd, StorePutEndReply),
    StoreOp.PUT_ABORT: Route("/store/put_abort", StoreKeys, StoreRemoveReply),
    StoreOp.GET: Route("/store/get", StoreGet, StoreGetReply),
    StoreOp.RELEASE: Route("/store/release", StoreRelease, StoreReleaseReply),
    StoreOp.EXISTS: Route("/store/exists", StoreKeys, StoreExistsReply),
    StoreOp.REMOVE: Route("/store/remove", StoreKeys, StoreRemoveReply),
}
STORE_EXISTS = STORE_ROUTES[StoreOp.EXISTS]
STORE_REMOVE = STORE_ROUTES[StoreOp.REMOVE]
STORE_REPLICATE = Route("/store/replicate", StoreReplicate, StoreReplicateReply)


# --- client side -------------------------------------------------------------------------------
class CallError(Exception):
    """A call to an internal route failed; `status` is the HTTP status, None if none came."""

    def __init__(self, route: Route[Any, Any], url: str, message: str,
                 status: int | None = None, detail: str = "", body: str = "") -> None:
        super().__init__(message)
        self.route = route
        self.url = url
        self.status = status
        self.detail = detail
        self.body = body  # the answer's first characters (non-2xx), for logs


class PeerUnreachable(CallError):
    """No answer: connection refused or reset, or a timeout (the peer may be down)."""


class PeerRefused(CallError):
    """A non-2xx answer: `status`, `detail` (FastAPI's `detail`, else the body's start), `body`."""


class InvalidReply(CallError, ValueError):
    """A 2xx answer whose body is not the route's reply type."""


def _refused(route: Route[Any, Any], url: str, response: httpx.Response) -> PeerRefused:
    detail = _detail(response)
    return PeerRefused(route, url, f"{url}: HTTP {response.status_code}: {detail}",
                       response.status_code, detail, response.text[:_DETAIL_CHARS])


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail or response.text[:_DETAIL_CHARS] or f"HTTP {response.status_code}")


def _content(route: Route[Any, Any], body: BaseModel | None) -> str | None:
    if route.request is None:
        return None
    if not isinstance(body, route.request):
        raise TypeError(f"{route.path} takes a {route.request.__name__}, "
                        f"not {type(body).__name__}")
    return body.model_dump_json()


async def _answer(http: httpx.AsyncClient, url: str, route: Route[Any, Any],
                  body: BaseModel | None, headers: Mapping[str, str] | None,
                  timeout: Any) -> httpx.Response:
    content = _content(route, body)
    sent = {**(headers or {}), **(_JSON if content is not None else {})}
    try:
        response = await http.request(route.method, url, content=content, headers=sent,
                                      timeout=timeout)
    except httpx.TransportError as exc:
        raise PeerUnreachable(route, url, f"{url} unreachable: {exc!r}") from exc
    except httpx.HTTPError as exc:
        raise CallError(route, url, f"{url} failed: {exc!r}") from exc
    if not response.is_success:
        raise _refused(route, url, response)
    return response


async def call_at(http: httpx.AsyncClient, url: str, route: Route[Any, Rep],
                  body: BaseModel | None = None, *, headers: Mapping[str, str] | None = None,
                  timeout: Any = httpx.USE_CLIENT_DEFAULT) -> Rep:
    """`call` where the caller already holds the route's full URL."""
    response = await _answer(http, url, route, body, headers, timeout)
    return route.parse(response.content, url)


async def call(http: httpx.AsyncClient, base_url: str, route: Route[Any, Rep],
               body: BaseModel | None = None, *, headers: Mapping[str, str] | None = None,
               timeout: Any = httpx.USE_CLIENT_DEFAULT) -> Rep:
    """Call `route` on the instance at `base_url`; its reply, validated (CallError if not 2xx).

    `headers` carry the cluster secret (`wire.auth.secret_headers`); `timeout` defaults to the
    client's.
    """
    return await call_at(http, route.url(base_url), route, body, headers=headers,
                         timeout=timeout)


async def send(http: httpx.AsyncClient, base_url: str, route: Route[Any, Any],
               body: BaseModel | None = None, *, headers: Mapping[str, str] | None = None,
               timeout: Any = httpx.USE_CLIENT_DEFAULT) -> None:
    """Call `route` for its effect: success is checked (CallError if not 2xx), the body is not."""
    await _answer(http, route.url(base_url), route, body, headers, timeout)


@asynccontextmanager
async def open_stream(http: httpx.AsyncClient, base_url: str, route: Route[Any, Any],
                      body: BaseModel | None = None, *,
                      headers: Mapping[str, str] | None = None,
                      timeout: Any = httpx.USE_CLIENT_DEFAULT) -> AsyncIterator[
                          AsyncIterator[str]]:
    """Open a stream route; yields an iterator of its lines (raw: `route.parse` each one).

    Opening raises PeerRefused (its body read) or PeerUnreachable; a connection lost while the
    lines are read raises PeerUnreachable from the iteration. Leaving the block closes it.
    """
    url = route.url(base_url)
    content = _content(route, body)
    sent = {**(headers or {}), **(_JSON if content is not None else {})}
    request = http.build_request(route.method, url, content=content, headers=sent,
                                 timeout=timeout)
    try:
        response = await http.send(request, stream=True)
    except httpx.TransportError as exc:
        raise PeerUnreachable(route, url, f"{url} unreachable: {exc!r}") from exc
    except httpx.HTTPError as exc:
        raise CallError(route, url, f"{url} failed: {exc!r}") from exc
    try:
        if not response.is_success:
            try:
                await response.aread()
            except httpx.HTTPError as exc:
                raise PeerUnreachable(route, url, f"{url} failed mid-answer: {exc!r}") from exc
            raise _refused(route, url, response)
        yield _lines(route, url, response)
    finally:
        await response.aclose()


async def _lines(route: Route[Any, Any], url: str,
                 response: httpx.Response) -> AsyncIterator[str]:
    try:
        async for line in response.aiter_lines():
            yield line
    except httpx.TransportError as exc:
        raise PeerUnreachable(route, url, f"{url} failed mid-stream: {exc!r}") from exc


# --- server side -------------------------------------------------------------------------------
RouteHandler = Callable[..., Any]


def serve(app: FastAPI | APIRouter, route: Route[Any, Any], *,
          dependencies: Sequence[Depends] | None = None,
          name: str | None = None) -> Callable[[RouteHandler], RouteHandler]:
    """Decorator: register the handler under `route` (FastAPI validates its body and documents
    the reply type); TypeError at build time if the handler does not take the route's request.
    """

    def register(handler: RouteHandler) -> RouteHandler:
        check_takes(handler, route)
        app.add_api_route(
            route.path, handler, methods=[route.method], dependencies=dependencies,
            name=name or handler.__name__,
            # A stream route answers a StreamingResponse; its lines are not one model.
            response_model=None if route.stream else route.reply)
        return handler

    return register


def check_takes(handler: RouteHandler, route: Route[Any, Any]) -> None:
    """TypeError unless `handler`'s parameters include one of type `route.request` (if any)."""
    if route.request is None:
        return
    hints = getattr(handler, "__annotations__", {})
    try:
        hints = get_type_hints(handler)
    except (NameError, TypeError):
        pass  # NOTE: annotations set at run time (store's generated handlers) are types already
    if route.request not in [t for k, t in hints.items() if k != "return"]:
        raise TypeError(f"handler {handler.__name__} for {route.path} must take a "
                        f"{route.request.__name__}")
