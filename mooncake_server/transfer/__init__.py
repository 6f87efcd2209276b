"""Transfer engine: move KV bytes between registered memory of different processes.

Register memory once, open a peer's segment, then submit batches of READ/WRITE requests and
await them. Transports: shared memory for same-host peers, TCP otherwise (RDMA not built here).
"""

from __future__ import annotations

from mooncake_server.transfer.engine import (
    Op,
    TransferEngine,
    TransferRequest,
    TransferState,
    TransferStatus,
    crc32c,
)
from mooncake_server.transfer.errors import TransferError

__all__ = [
    "Op",
    "TransferEngine",
    "TransferError",
    "TransferRequest",
    "TransferState",
    "TransferStatus",
    "crc32c",
]
