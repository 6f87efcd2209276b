"""Mooncake's `mooncake.store` names, from mooncake-server's implementation."""

from mooncake_server.mooncake_api import (  # noqa: F401 - re-exported under Mooncake's names
    BufferHandle,
    ErrorCode,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
