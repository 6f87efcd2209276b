"""The store node's control API as typed calls, served twice: over the binary RPC channel (the
fast path every StoreClient uses) and as HTTP routes (operators, curl, older clients).

Every call only moves metadata; the bytes go through the transfer engine. All calls run on the
store role's event loop, which serialises access to the object table.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from mooncake_server.roles.store.eviction import pin_seconds
from mooncake_server.roles.store.node import StoreNode
from mooncake_server.roles.store.objects import GetResult
from mooncake_server.wire.routes import STORE_ROUTES
from mooncake_server.wire.rpc import Call, Handler, RpcUnavailable, current_peer, json_handler
from mooncake_server.wire.store_ops import (
    StoreExistsReply,
    StoreGet,
    StoreGetReply,
    StoreKeys,
    StoreOp,
    StorePutEnd,
    StorePutEndReply,
    StorePutStart,
    StorePutStartReply,
    StoreRelease,
    StoreReleaseReply,
    StoreRemoveReply,
)

logger = logging.getLogger(__name__)

_MAX_TRACKED_WRITERS = 256


class StoreService:
    """put_start / put_end / put_abort / get / release / exists / remove on one node."""

    def __init__(self, node: Callable[[], StoreNode | None]) -> None:
        """`node` returns the running node, or None while the role starts or stops."""
        self._node = node
        # Per RPC connection, its writers' reserved keys: a writer whose connection ends (it
        # died mid-put) loses its reservations at once, not at the write timeout.
        self._writers: dict[object, dict[str, list[str]]] = {}

    def node(self) -> StoreNode:
        """The running node; RpcUnavailable while there is none."""
        node = self._node()
        if node is None:
            raise RpcUnavailable("store is starting")
        return node

    def put_start(self, body: StorePutStart) -> StorePutStartReply:
        """Reserve space for new keys."""
        node = self.node()
        res = node.put_start(body.keys, body.sizes, body.writer, pin_seconds(body.pin_ms))
        peer = current_peer.get()
        if peer is not None and body.writer:
            writers = self._writers.setdefault(peer, {})
            if len(writers) >= _MAX_TRACKED_WRITERS:  # forget writers that finished
                for writer, keys in list(writers.items()):
                    if not any(node.table.is_writing(k) for k in keys):
                        del writers[writer]
            writers[body.writer] = [k for k, off in zip(body.keys, res.offsets)
                                    if off is not None]
        return StorePutStartReply(offsets=res.offsets, refused=res.refused)

    def disconnected(self, peer: object) -> None:
        """An RPC connection ended: free what its writers still had reserved."""
        writers = self._writers.pop(peer, {})
        node = self._node()
        if node is None:
            return
        freed = sum(node.put_abort(keys, writer) for writer, keys in writers.items())
        if freed:
            logger.info("a writer's connection ended mid-put: freed %d reservations", freed)

    def put_end(self, body: StorePutEnd) -> StorePutEndReply:
        """Commit written keys with their checksums."""
        return StorePutEndReply(committed=self.node().put_end(body.keys, body.checksums))

    def put_abort(self, body: StoreKeys) -> StoreRemoveReply:
        """Free reservations whose write failed."""
        return StoreRemoveReply(removed=self.node().put_abort(body.keys, body.writer))

    def get(self, body: StoreGet) -> StoreGetReply | Awaitable[StoreGetReply]:
        """Lease the leading held keys (sparse: all held keys) and say where their bytes are;
        answers at once unless a key must first be read back from SSD."""
        node = self.node()
        res = node.get_now(body.keys, body.lease_s, sparse=body.sparse)
        if res is not None:
            return _get_reply(body, res)
        return self._get_later(node, body)

    async def _get_later(self, node: StoreNode, body: StoreGet) -> StoreGetReply:
        return _get_reply(body, await node.get(body.keys, body.lease_s, sparse=body.sparse))

    def release(self, body: StoreRelease) -> StoreReleaseReply:
        """End a get's lease."""
        return StoreReleaseReply(released=self.node().release(body.lease_id))

    def exists(self, body: StoreKeys) -> StoreExistsReply:
        """Per key presence and the leading run held."""
        flags, prefix = self.node().exists(body.keys)
        return StoreExistsReply(exists=flags, prefix=prefix)

    def remove(self, body: StoreKeys) -> StoreRemoveReply:
        """Remove keys from both tiers."""
        return StoreRemoveReply(removed=self.node().remove(body.keys))

    def calls(self) -> dict[StoreOp, Call]:
        """Each op's method (its request type is its route's, wire/routes.py)."""
        return {
            StoreOp.PUT_START: self.put_start,
            StoreOp.PUT_END: self.put_end,
            StoreOp.PUT_ABORT: self.put_abort,
            StoreOp.GET: self.get,
            StoreOp.RELEASE: self.release,
            StoreOp.EXISTS: self.exists,
            StoreOp.REMOVE: self.remove,
        }

    def rpc_handlers(self) -> dict[int, Handler]:
        """The ops as RPC handlers: JSON payload in, JSON reply out."""
        return {int(op): json_handler(STORE_ROUTES[op].request, method)
                for op, method in self.calls().items()}


def _get_reply(body: StoreGet, res: GetResult) -> StoreGetReply:
    objs = res.objects
    present: list[bool] = []
    if body.sparse:
        found = {o.key for o in objs}
        present = [k in found for k in body.keys]
    return StoreGetReply(lease_id=res.lease_id, found=len(objs),
                         offsets=[o.offset for o in objs], sizes=[o.size for o in objs],
                         checksums=[o.checksum or 0 for o in objs], present=present)
