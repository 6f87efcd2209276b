"""Shared plumbing for every role's HTTP server: the cluster-secret guards and /metrics.

Two layers keep internal endpoints closed: each internal route depends on `require_secret`, and
`SecretGuard` (installed on every role's app by `roles.app_for_role`) refuses any path that is not
explicitly public, so a route added later without the dependency is still closed by default.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping

from fastapi import Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

# NOTE: every internal HTTP request carries the cluster secret in this header.
SECRET_HEADER = "X-Mooncake-Secret"
# Paths every role answers without the secret: liveness only.
OPEN_PATHS: frozenset[str] = frozenset({"/health"})
_DENIED = json.dumps({"detail": "missing or wrong cluster secret"}).encode()


def same_secret(given: str | None, secret: str) -> bool:
    """Constant-time comparison; an unset `secret` accepts everything."""
    if not secret:
        return True
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def header_value(scope: Scope, name: str) -> str | None:
    """One request header of an ASGI scope (latin-1, as HTTP defines), or None."""
    key = name.lower().encode()
    for k, v in scope.get("headers", ()):
        if k == key:
            return bytes(v).decode("latin-1")
    return None


def scope_has_secret(scope: Scope, secret: str) -> bool:
    """True if the request carries the cluster secret (X-Mooncake-Secret or Bearer)."""
    if not secret:
        return True
    if same_secret(header_value(scope, SECRET_HEADER), secret):
        return True
    return same_secret(bearer_token(header_value(scope, "authorization")), secret)


def require_secret(secret: str) -> Callable[..., Awaitable[None]]:
    """FastAPI dependency that refuses internal calls without the cluster secret (401)."""

    # NOTE: async so FastAPI runs it on the loop; a plain def costs a thread-pool hop per call.
    async def check(x_mooncake_secret: str | None = Header(default=None,
                                                           alias=SECRET_HEADER)) -> None:
        if not same_secret(x_mooncake_secret, secret):
            raise HTTPException(status_code=401, detail="missing or wrong cluster secret")

    return check


class SecretGuard:
    """ASGI middleware: every path but the public ones needs the cluster secret (deny by default).

    `open_paths` match exactly, `open_prefixes` by prefix; both are answered as the app decides.
    """

    def __init__(self, app: ASGIApp, secret: str, open_paths: Iterable[str] = OPEN_PATHS,
                 open_prefixes: Iterable[str] = ()) -> None:
        self.app = app
        self.secret = secret
        self.open_paths = frozenset(open_paths)
        self.open_prefixes = tuple(open_prefixes)

    def _is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(self.open_prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, or answer 401 without reading its body."""
        if (scope["type"] in ("http", "websocket") and not self._is_open(scope["path"])
                and not scope_has_secret(scope, self.secret)):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await send_json(send, 401, _DENIED, {"www-authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


async def send_json(send: Send, status: int, body: bytes,
                    headers: Mapping[str, str] | None = None) -> None:
    """Answer an ASGI HTTP request directly with a JSON body, before or without reading its body.

    NOTE: no `connection: close`: closing while the client still sends its body makes the
    kernel answer that body with a reset, which can destroy this very answer on its way (RFC
    9112 section 9.6). Kept open, the HTTP server reads and drops the unread body, then serves
    the next request on the connection (tests/security/test_early_refusals.py).
    """
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def secret_headers(secret: str) -> dict[str, str]:
    """Headers an internal client sends so peers accept it."""
    return {SECRET_HEADER: secret} if secret else {}


def metrics_response(registry: CollectorRegistry) -> Response:
    """Prometheus text exposition of one role's registry."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
