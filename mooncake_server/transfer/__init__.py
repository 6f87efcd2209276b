"""Transfer engine: move KV bytes between registered memory of different processes.

Register memory once, open a peer's segment, then submit batches of READ/WRITE requests and
await them. Transports, chosen per peer: shared memory for same-host peers, RDMA (libibverbs,
where built and a device exists), TCP otherwise.
"""

from __future__ import annotations

from mooncake_server.transfer.engine import (
    Op,
    PublishedObject,
    TransferEngine,
    TransferRequest,
    TransferState,
    TransferStatus,
    crc32c,
    crc32c_combine,
    crc32c_many,
)
from mooncake_server.transfer.errors import TransferError
from mooncake_server.transfer.transports import RdmaProbe, pick_transport, probe_rdma_devices

__all__ = [
    "Op",
    "PublishedObject",
    "RdmaProbe",
    "TransferEngine",
    "TransferError",
    "TransferRequest",
    "TransferState",
    "TransferStatus",
    "crc32c",
    "crc32c_combine",
    "crc32c_many",
    "pick_transport",
    "probe_rdma_devices",
]
