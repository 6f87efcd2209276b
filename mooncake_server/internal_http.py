"""Shared plumbing for every role's HTTP server: the cluster-secret guard and /metrics."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mooncake_server.messages import SECRET_HEADER


def require_secret(secret: str) -> Callable[..., None]:
    """FastAPI dependency that refuses internal calls without the cluster secret (401)."""

    def check(x_mooncake_secret: str | None = Header(default=None, alias=SECRET_HEADER)) -> None:
        if not secret:
            return
        if x_mooncake_secret is None or not hmac.compare_digest(x_mooncake_secret, secret):
            raise HTTPException(status_code=401, detail="missing or wrong cluster secret")

    return check


def secret_headers(secret: str) -> dict[str, str]:
    """Headers an internal client sends so peers accept it."""
    return {SECRET_HEADER: secret} if secret else {}


def metrics_response(registry: CollectorRegistry) -> Response:
    """Prometheus text exposition of one role's registry."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
