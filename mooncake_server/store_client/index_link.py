"""IndexLink: a client's calls to the store master's index, over HTTP until the master names its
binary channel, then over that channel (one persistent, authenticated connection; no HTTP
request on either side).

Each HTTP call costs about a millisecond on loopback (request parsing, routing, a new task per
request); a put through Mooncake's API asks the index twice (place, committed) and a get once,
which made small values several times slower than Mooncake's RPC master. The channel carries the
same JSON bodies. If it fails, calls go over HTTP for `channel_retry_s`, then it is dialled
again (the same recovery as a store node's reporter). A channel belongs to the master it was
learned from: when the master to ask changes (conductors come and go), it is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from mooncake_server.store_client.client import StoreError
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.index import IndexOp
from mooncake_server.wire.routes import (
    INDEX_COMMITTED,
    INDEX_DROP,
    INDEX_LOCATE,
    INDEX_PLACE,
    CallError,
    InvalidReply,
    PeerRefused,
    Route,
    call,
)
from mooncake_server.wire.rpc import RpcClient, RpcError, RpcStatus

logger = logging.getLogger(__name__)

_Reply = TypeVar("_Reply", bound=Any)

# The routes the channel also serves (the master's `rpc_handlers`).
CHANNEL_OPS: dict[str, IndexOp] = {
    INDEX_LOCATE.path: IndexOp.LOCATE,
    INDEX_PLACE.path: IndexOp.PLACE,
    INDEX_COMMITTED.path: IndexOp.COMMITTED,
    INDEX_DROP.path: IndexOp.DROP,
}


class IndexRefused(StoreError):
    """The index refused a call as invalid (HTTP 400 / BAD_REQUEST): `detail` says why."""

    def __init__(self, route: str, detail: str) -> None:
        """`detail`: the index's own words."""
        super().__init__(f"store index {route} refused: {detail}")
        self.detail = detail


class IndexLink:
    """Calls to one master's index (the one `master_url` names now)."""

    def __init__(self, master_url: Callable[[], str], http: httpx.AsyncClient, secret: str,
                 channel_retry_s: float = 30.0) -> None:
        """`http` is the caller's client; the channel uses its read timeout."""
        self._master = master_url
        self._http = http
        self._secret = secret
        self._headers = secret_headers(secret)
        self._channel: RpcClient | None = None
        self._channel_of = ""  # the master URL the channel was learned from
        self._retry_s = channel_retry_s
        self._down_until = float("-inf")
        self.calls_on_channel = 0

    async def ask(self, route: Route[Any, _Reply], body: BaseModel) -> _Reply:
        """One call to the index; StoreError unless it answers (an invalid reply stays a
        ValueError, as a bug on either side)."""
        master = self._master()
        if self._channel is not None and self._channel_of != master:
            await self.aclose()
        op = CHANNEL_OPS.get(route.path)
        # NOTE: a local, not self._channel: calls in flight together fail together, and the
        # first to see it closes the channel under the others.
        channel = self._channel
        if channel is not None and op is not None:
            try:
                raw = await channel.call(op, body.model_dump_json().encode())
            except RpcError as exc:
                if exc.status == RpcStatus.BAD_REQUEST:
                    raise IndexRefused(route.path, str(exc).rpartition("): ")[2]) from exc
                if self._channel is channel:
                    logger.info("index channel %s failed (%s); asking over HTTP",
                                channel.address, exc)
                    await self.aclose()
                    self._down_until = asyncio.get_running_loop().time() + self._retry_s
            else:
                self.calls_on_channel += 1
                return route.parse(raw, f"rpc://{channel.address}{route.path}")
        try:
            reply = await call(self._http, master, route, body, headers=self._headers)
        except PeerRefused as exc:
            if exc.status == 400:
                raise IndexRefused(route.path, exc.body) from exc
            raise StoreError(f"store index {route.path} failed: HTTP {exc.status}: "
                             f"{exc.body}") from exc
        except InvalidReply:
            raise
        except CallError as exc:
            raise StoreError(f"store index unreachable at {exc.url}: "
                             f"{exc.__cause__!r}") from exc
        channel = getattr(reply, "channel", None)
        if (channel and self._channel is None
                and asyncio.get_running_loop().time() >= self._down_until):
            self._channel = RpcClient(channel, self._secret.encode(), self._http.timeout.read)
            self._channel_of = master
        return reply

    async def aclose(self) -> None:
        """Close the channel (a later answer naming it opens it again)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.aclose()
