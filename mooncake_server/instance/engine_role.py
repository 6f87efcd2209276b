"""Pieces every engine role (prefill, decode) builds the same way."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from mooncake_server.config import ServerConfig
from mooncake_server.engine.factory import ModelInfo, build_runner
from mooncake_server.engine.forward_thread import forward_thread, no_team_on_this_thread
from mooncake_server.engine.model_runner import ModelRunner
from mooncake_server.instance.app import Starting
from mooncake_server.store_client.kv_link import KVStoreLink
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


@dataclass
class EngineParts:
    """What an engine role runs on: model runner, forward thread, store link, control client."""

    engine: TransferEngine
    executor: ThreadPoolExecutor
    runner: ModelRunner
    info: ModelInfo
    http: httpx.AsyncClient
    link: KVStoreLink


async def start_engine(starting: Starting, name: str) -> EngineParts:
    """Build the engine parts of role `name`; they close, at shutdown, in the reverse order
    (store link, control client, forward thread, core budget, transfer engine last)."""
    config, stack = starting.config, starting.stack
    engine = make_transfer_engine(config, serve=False)
    stack.callback(engine.close)
    executor = forward_thread(name)
    runner, info = await asyncio.get_running_loop().run_in_executor(
        executor, build_runner, config, lambda nbytes: engine.alloc_shared(f"{name}-kv", nbytes))
    no_team_on_this_thread()  # the event loop samples; the forward thread computes
    stack.callback(runner.cores.close)
    stack.callback(executor.shutdown, wait=True)
    http = internal_client(config)
    stack.push_async_callback(http.aclose)
    conductors = (await starting.cluster()).conductors
    # The store master: a standalone one (--master), or the conductor's own.
    master_base = config.master_base
    master = (lambda: master_base) if master_base else conductors.current
    link = KVStoreLink(runner.kv, engine, http, config.cluster_secret, master)
    stack.push_async_callback(link.aclose)
    return EngineParts(engine, executor, runner, info, http, link)
