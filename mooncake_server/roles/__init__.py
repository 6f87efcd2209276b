"""One module per role; `app_for_role` picks the HTTP app of a single-role process."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mooncake_server.config import ServerConfig

# Roles serving the public OpenAI API (their /v1/* and /metrics are guarded by the API key).
API_ROLES = ("conductor", "colocated")


def app_for_role(config: ServerConfig) -> FastAPI:
    """Build the FastAPI app of `config.role` (not `all`, which supervises processes).

    Every path the role does not declare public needs the cluster secret (`SecretGuard`), on top
    of the per-route checks, so an endpoint added without its guard is still closed.
    """
    from mooncake_server.api.security import PUBLIC_PATHS, PUBLIC_PREFIXES
    from mooncake_server.wire.auth import OPEN_PATHS, SecretGuard

    module = import_module(f"mooncake_server.roles.{config.role}.app")
    app: FastAPI = module.build_app(config)
    if config.role in API_ROLES:
        app.add_middleware(SecretGuard, secret=config.cluster_secret,
                           open_paths=OPEN_PATHS | PUBLIC_PATHS, open_prefixes=PUBLIC_PREFIXES)
    else:
        app.add_middleware(SecretGuard, secret=config.cluster_secret)
    return app
