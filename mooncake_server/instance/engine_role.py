"""Pieces every engine role (prefill, decode) builds the same way."""

from __future__ import annotations

import httpx

from mooncake_server.config import ServerConfig
from mooncake_server.transfer import TransferEngine
from mooncake_server.wire.auth import secret_headers


def instance_id(config: ServerConfig) -> str:
    """This instance's id in the registry: --instance-id or role@host:port."""
    return config.instance_id or f"{config.role}@{config.public_host}:{config.port}"


def make_transfer_engine(config: ServerConfig, serve: bool) -> TransferEngine:
    """The role's transfer engine; `serve` only where peers access this role's memory."""
    return TransferEngine(
        secret=config.secret_bytes, listen_host=config.host, listen_port=config.transfer_port,
        transport=config.transport, timeout_s=config.transfer_timeout_s, serve=serve)


def internal_client(config: ServerConfig) -> httpx.AsyncClient:
    """HTTP client for control calls to other roles (store, index, reports): cluster secret
    attached, every call bounded by `control_timeout_s`."""
    limit = control_timeout_s(config)
    return httpx.AsyncClient(
        headers=secret_headers(config.cluster_secret),
        timeout=httpx.Timeout(limit, connect=min(5.0, limit)),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
    )


def control_timeout_s(config: ServerConfig) -> float:
    """How long one control call may take. NOTE: a peer behind a dead link never answers on a
    kept-alive connection (no reset arrives), so only a read timeout ends the wait."""
    return max(5.0, 2 * config.transfer_timeout_s)
