"""Pieces every engine role (prefill, decode) builds the same way."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from mooncake_server.config import ServerConfig
from mooncake_server.engine.core_budget import CoreBudget, FixedThreads
from mooncake_server.engine.factory import ModelInfo, build_runner
from mooncake_server.engine.forward_thread import forward_thread, no_team_on_this_thread
from mooncake_server.engine.model_runner import ModelRunner
from mooncake_server.instance.app import Starting
from mooncake_server.store_client.kv_link import KVStoreLink
from mooncake_server.transfer import TransferEngine
from mooncake_server.wire.auth import secret_headers

log = logging.getLogger(__name__)

# NOTE: the longest an engine waits for the others on its cores to load before timing its
# start-up passes (two engines loading side by side took 25-30 s on the 2-core machine).
NEIGHBOUR_LOAD_WAIT_S = 120.0
_POLL_S = 0.05


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


async def after_neighbours_load(cores: CoreBudget | FixedThreads,
                                timeout_s: float = NEIGHBOUR_LOAD_WAIT_S) -> float:
    """Wait until no other engine on these cores is loading its model (at most `timeout_s`);
    the seconds waited.

    An engine times passes at start-up (a decode's quiet step, a prefill's long pass) that seed
    what the conductor predicts until real passes are timed. A neighbour loading its model
    works outside the turns on the cores: a decode's quiet step timed while the prefill beside
    it loaded read 383 ms, 10.6x the cost model's, and the conductor, estimating every request's
    TBT at 423-563 ms against a 200 ms SLO, refused all of them on an idle cluster; refused,
    none ran to time a faster step.
    """
    start = time.monotonic()
    while cores.others_loading():
        if time.monotonic() - start >= timeout_s:
            log.warning("timing start-up passes while %d engine(s) beside this one still load "
                        "after %.0f s: the times read may be slow", cores.others_loading(),
                        timeout_s)
            break
        await asyncio.sleep(_POLL_S)
    return time.monotonic() - start
