"""The conductor's way to its store master: the one it runs inside itself (`LocalMaster`, the
default) or a standalone `--role master` process (`RemoteMaster`, `--master HOST:PORT`).

The conductor asks the master three things per request: the longest cached prefix (the
scheduler's oracle), where a tail block lives (to remove it), and that a cached prefix was
reused (hot blocks gain copies); and, for /health, how many store nodes are alive.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, TypeVar

import httpx
from pydantic import BaseModel

from mooncake_server.roles.master.master import StoreMaster
from mooncake_server.wire.auth import secret_headers
from mooncake_server.wire.index import StoreLocate, StoreLocateReply, StorePrefixReply
from mooncake_server.wire.routes import (
    INDEX_LOCATE,
    INDEX_PREFIX,
    INDEX_REUSE,
    CallError,
    PeerRefused,
    Route,
    call,
)
from mooncake_server.wire.store_ops import StoreKeys

log = logging.getLogger(__name__)

_Reply = TypeVar("_Reply", bound=BaseModel)


class MasterUnavailable(RuntimeError):
    """The standalone store master did not answer."""


class MasterLink(Protocol):
    """What the conductor asks of its store master."""

    registers_stores: bool  # store nodes register with this conductor (not a standalone master)

    async def prefix(self, keys: list[str]) -> StorePrefixReply:
        """Longest prefix cached anywhere, and per live node."""
        ...

    async def locate(self, keys: list[str]) -> StoreLocateReply:
        """Live replicas of each key."""
        ...

    def reuse(self, keys: list[str]) -> None:
        """A request reuses these cached keys (in the background: hot blocks gain copies)."""
        ...

    async def store_nodes(self) -> int:
        """Live store nodes."""
        ...


class LocalMaster:
    """The master inside this conductor: direct calls, no I/O."""

    registers_stores = True

    def __init__(self, master: StoreMaster, http: httpx.AsyncClient | None = None) -> None:
        """`http` carries hot-block copy requests to store nodes (None: no copies)."""
        self.master = master
        self.http = http

    async def prefix(self, keys: list[str]) -> StorePrefixReply:
        """From the in-memory index."""
        return self.master.prefix(keys)

    async def locate(self, keys: list[str]) -> StoreLocateReply:
        """From the in-memory index."""
        return self.master.locate(keys)

    def reuse(self, keys: list[str]) -> None:
        """Count hits; copies run as background tasks of the master."""
        if self.http is not None:
            self.master.reuse(keys, self.http)
        else:
            self.master.note_hits(keys)

    async def store_nodes(self) -> int:
        """Live store nodes in this conductor's registry."""
        return len(self.master.live_nodes())


class RemoteMaster:
    """A `--role master` process, over HTTP with the cluster secret."""

    registers_stores = False

    def __init__(self, url: str, secret: str, timeout_s: float = 5.0) -> None:
        """Talk to the master at `url` (an http:// base URL)."""
        self.url = url.rstrip("/")
        self._headers = secret_headers(secret)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
        self._background: set[asyncio.Task[None]] = set()

    async def prefix(self, keys: list[str]) -> StorePrefixReply:
        """One call; a master that does not answer means nothing is known cached."""
        try:
            return await self._call(INDEX_PREFIX, StoreKeys(keys=keys))
        except MasterUnavailable as exc:
            log.warning("%s", exc)
            return StorePrefixReply(prefix=0, by_node={})

    async def locate(self, keys: list[str]) -> StoreLocateReply:
        """One call; raises MasterUnavailable."""
        return await self._call(INDEX_LOCATE, StoreLocate(keys=keys))

    def reuse(self, keys: list[str]) -> None:
        """Sent without waiting (hot copies are an optimisation)."""
        task = asyncio.get_running_loop().create_task(self._reuse(keys))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reuse(self, keys: list[str]) -> None:
        try:
            await self._call(INDEX_REUSE, StoreKeys(keys=keys))
        except MasterUnavailable as exc:
            log.debug("%s", exc)

    async def store_nodes(self) -> int:
        """From the master's /health (0 if it does not answer)."""
        try:
            reply = await self._http.get(f"{self.url}/health")
            return int(reply.json().get("stores", 0)) if reply.status_code == 200 else 0
        except (httpx.HTTPError, ValueError):
            return 0

    async def aclose(self) -> None:
        """Wait for reuse notes in flight, then close the connection pool."""
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._http.aclose()

    async def _call(self, route: Route[Any, _Reply], body: BaseModel) -> _Reply:
        try:
            return await call(self._http, self.url, route, body, headers=self._headers)
        except (PeerRefused, CallError) as exc:
            raise MasterUnavailable(f"store master {self.url}{route.path} failed: "
                                    f"{exc}") from exc
