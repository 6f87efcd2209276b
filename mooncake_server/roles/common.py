"""Pieces every engine role (prefill, decode) builds the same way."""

from __future__ import annotations

import httpx

from mooncake_server.config import ServerConfig
from mooncake_server.internal_http import secret_headers
from mooncake_server.transfer import TransferEngine


def instance_id(config: ServerConfig) -> str:
    """This instance's id in the registry: --instance-id or role@host:port."""
    return config.instance_id or f"{config.role}@{config.public_host}:{config.port}"


def make_transfer_engine(config: ServerConfig, serve: bool) -> TransferEngine:
    """The role's transfer engine; `serve` only where peers access this role's memory."""
    return TransferEngine(
        secret=config.secret_bytes, listen_host=config.host, listen_port=config.transfer_port,
        transport=config.transport, timeout_s=config.transfer_timeout_s, serve=serve)


def internal_client(config: ServerConfig) -> httpx.AsyncClient:
    """HTTP client for calls to other roles: cluster secret attached, no read timeout on streams."""
    return httpx.AsyncClient(
        headers=secret_headers(config.cluster_secret),
        timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
    )
