"""Who may call the public API, and how many body bytes a request may send.

`ApiGuard` is ASGI middleware in front of the OpenAI routes, so it decides before any route reads
the body: `/v1/*` needs `Authorization: Bearer API_KEY` when a key is set (401 with OpenAI's
`invalid_api_key` body otherwise); `/metrics` then needs the API key or the cluster secret. A /v1
body larger than the limit is refused with 413: at once when Content-Length says so, otherwise as
soon as the streamed bytes pass the limit, so a huge body is never held in memory.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mooncake_server.api.errors import APIError, error_body
from mooncake_server.wire.auth import (
    bearer_token,
    header_value,
    same_secret,
    scope_has_secret,
    send_json,
)

API_PREFIX = "/v1"
# Paths of an API role that need no cluster secret (ApiGuard applies the API key to them).
PUBLIC_PATHS = frozenset({API_PREFIX, "/metrics", "/openapi.json", "/docs",
                          "/docs/oauth2-redirect", "/redoc"})
PUBLIC_PREFIXES = (API_PREFIX + "/",)


class BodyTooLarge(APIError):
    """A request body over --max-request-size (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes (--max-request-size)", 413,
                         code="request_too_large")


def _unauthorized(given: str | None) -> bytes:
    if given is None:
        message = ("You didn't provide an API key. You need to provide your API key in an "
                   "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    else:
        message = "Incorrect API key provided."
    body = error_body(message, "invalid_request_error", None, "invalid_api_key")
    return json.dumps(body).encode()


def limit_body(receive: Receive, limit: int) -> Callable[[], Awaitable[Message]]:
    """`receive` that raises BodyTooLarge once more than `limit` body bytes arrived."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return limited


class ApiGuard:
    """ASGI middleware: API key and body-size limit of the public API (see module docstring)."""

    def __init__(self, app: ASGIApp, *, api_key: str, secret: str, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.secret = secret
        self.max_body_bytes = max_body_bytes

    def _key_ok(self, scope: Scope) -> tuple[bool, str | None]:
        given = bearer_token(header_value(scope, "authorization"))
        return (not self.api_key or same_secret(given, self.api_key)), given

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the request, then hand it on with a size-limited body stream."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == "/metrics" and self.api_key:
            ok, given = self._key_ok(scope)
            # NOTE: an unset cluster secret must not open /metrics when an API key is set.
            if not ok and not (self.secret and scope_has_secret(scope, self.secret)):
                await send_json(send, 401, _unauthorized(given), {"www-authenticate": "Bearer"})
                return
        elif path == API_PREFIX or path.startswith(PUBLIC_PREFIXES):
            ok, given = self._key_ok(scope)
            if not ok:
                await send_json(send, 401, _unauthorized(given), {"www-authenticate": "Bearer"})
                return
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                exc = BodyTooLarge(self.max_body_bytes)
                await send_json(send, 413, json.dumps(exc.body()).encode())
                return
            receive = limit_body(receive, self.max_body_bytes)
        await self.app(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    raw: Any = header_value(scope, "content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:  # the HTTP server rejects these before us; be safe anyway
        return None
