"""A Mooncake client's own memory mounted into the pool (`global_segment_size` > 0): a store node
that lives inside the client process, as Mooncake's clients mount theirs (SGLang and vLLM size
it per process).

It is the store role's node, without the HTTP app: the DRAM pool registered with the client's
transfer engine, the object table (`StoreNode`), the binary control channel other clients put
and get through, registration and heartbeats with the master, index reports, the lease reaper.
`close()` deregisters first, so the master drops what the segment held (a closed client's data
is gone, as in Mooncake), then stops serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging

from mooncake_server.discovery.conductors import ConductorSet
from mooncake_server.instance.registrar import Registrar
from mooncake_server.roles.store.keyed import EngineKeyedReads
from mooncake_server.roles.store.node import StoreNode
from mooncake_server.roles.store.reporter import IndexReporters
from mooncake_server.roles.store.service import StoreService
from mooncake_server.transfer import TransferEngine
from mooncake_server.wire.index import StoreEntry
from mooncake_server.wire.instances import InstanceInfo, StoreLocation
from mooncake_server.wire.rpc import RpcServer

log = logging.getLogger(__name__)

_REAP_INTERVAL_S = 1.0


class MountedSegment:
    """`size` bytes of this process served as one store node of the cluster."""

    def __init__(self, engine: TransferEngine, name: str, size: int, host: str,
                 master_url: str, secret: str, heartbeat_s: float = 1.0) -> None:
        """Serve `size` bytes as segment `name` of `engine` (which must serve) on `host`."""
        self.engine = engine
        self.name = name
        self.size = size
        self.host = host
        self.master_url = master_url
        self.secret = secret
        self.heartbeat_s = heartbeat_s
        self.node: StoreNode | None = None
        self.location: StoreLocation | None = None
        self._rpc: RpcServer | None = None
        self._registrar: Registrar | None = None
        self._reporters: IndexReporters | None = None
        self._reaper: asyncio.Task[None] | None = None

    @property
    def node_id(self) -> str:
        """The node's id at the master: the engine's host:port (Mooncake's segment name)."""
        return self.engine.address

    async def start(self) -> None:
        """Allocate and register the pool, serve its control channel, join the master."""
        pool = self.engine.alloc_shared(self.name, self.size)
        pool_addr = ctypes.addressof(ctypes.c_char.from_buffer(pool))
        self.node = StoreNode(pool, pool_addr, report=self._changed,
                              keyed=EngineKeyedReads(self.engine, self.name))
        service = StoreService(lambda: self.node)
        self._rpc = RpcServer(service.rpc_handlers(), self.secret.encode(),
                              on_disconnect=service.disconnected)
        port = await self._rpc.start(self.host, 0)
        control = f"{self.host}:{port}"
        # NOTE: no HTTP app: peers use the control channel; the URL only names the node.
        url = f"http://{control}"
        self.location = StoreLocation(instance_id=self.node_id, url=url,
                                      transfer_address=self.engine.address, segment=self.name,
                                      control_address=control)
        info = InstanceInfo(instance_id=self.node_id, role="store", url=url,
                            transfer_address=self.engine.address, segment=self.name,
                            control_address=control)
        self._registrar = Registrar(self.master_url, info, self.secret, self.heartbeat_s)
        await self._registrar.start()
        self._reporters = IndexReporters(ConductorSet((self.master_url,)), self.node_id,
                                         self.secret, self.node.snapshot)
        await self._reporters.start()
        self._reaper = asyncio.create_task(self._reap_forever(), name="segment-reaper")
        log.info("mounted %d bytes as store segment %s at %s", self.size, self.name,
                 self.engine.address)

    def _changed(self, entry: StoreEntry) -> None:
        if self._reporters is not None:
            self._reporters.changed(entry)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            if self.node is not None:
                self.node.table.reap()

    def active_leases(self) -> int:
        """Reads of this segment in flight (leases held by readers)."""
        return self.node.stats().active_leases if self.node is not None else 0

    async def close(self) -> None:
        """Leave the master (its index forgets this segment), then stop serving."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._registrar is not None:
            await self._registrar.stop()
        if self._reporters is not None:
            await self._reporters.stop()
        if self._rpc is not None:
            await self._rpc.close()
        self.node = None
