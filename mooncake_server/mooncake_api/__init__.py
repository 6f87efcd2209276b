"""Mooncake's store client API (`mooncake.store`) on this project's store: what vLLM's Mooncake
store connector, SGLang's HiCache Mooncake backend and LMCache's `mooncakestore` backend call.

    from mooncake_server.mooncake_api import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    store.setup("127.0.0.1:17812", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "",
                "127.0.0.1:50051")   # a `mooncake-server --role master` on 50051

The cluster secret comes from MOONCAKE_CLUSTER_SECRET. The `compat/mooncake-store-api`
distribution makes this importable as `mooncake.store` for engines that import that name.
"""

from mooncake_server.mooncake_api.config import MooncakeConfig
from mooncake_server.mooncake_api.store import MooncakeDistributedStore
from mooncake_server.mooncake_api.surface import (
    BufferHandle,
    ErrorCode,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = ["BufferHandle", "ErrorCode", "MooncakeConfig", "MooncakeDistributedStore",
           "ReplicateConfig", "SoftPinAction"]
