"""The global store index channel: store nodes and engine roles <-> the conductor's store master.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field

from mooncake_server.wire.instances import StoreLocation

# Global store index (store nodes and engine roles <-> the conductor's store master).

class IndexOp(enum.IntEnum):
    """RPC op codes of the index's binary channel."""

    REPORT = 1


TIER_DRAM = "dram"
TIER_SSD = "ssd"


class StoreLocate(BaseModel):
    """Where are these keys? `fallback`: name the ring targets of keys the index lacks yet."""

    keys: list[str]
    fallback: bool = True


class StoreEntry(BaseModel):
    """What one store node holds under a key: its size and tier (None = no longer held)."""

    key: str
    size: int = Field(ge=0)
    tier: str | None  # "dram" | "ssd" | None


class StoreReport(BaseModel):
    """A store node's changes since its last report, or (snapshot) everything it holds."""

    node_id: str
    epoch: str  # new each time the node starts: a restarted node's old deltas are ignored
    seq: int = Field(ge=0)  # increases with every report of one epoch
    snapshot: bool = False
    entries: list[StoreEntry] = Field(default_factory=list)


class StoreReportReply(BaseModel):
    """resync = the master does not know this node's epoch: send a full snapshot."""

    accepted: bool
    resync: bool = False
    channel: str | None = None  # host:port of the index's binary channel: later reports go there


class StoreReplica(BaseModel):
    """One live copy of a key."""

    node_id: str
    tier: str


class StoreLocateReply(BaseModel):
    """Per key, its live replicas (DRAM copies first); `nodes` says how to reach each node."""

    nodes: dict[str, StoreLocation]
    replicas: list[list[StoreReplica]]


class StorePlaceReply(BaseModel):
    """Per key, the store nodes that should hold it (consistent hashing over live nodes)."""

    nodes: dict[str, StoreLocation]
    targets: list[list[str]]


class StorePrefixReply(BaseModel):
    """Longest cached prefix over all live nodes together, and on each node alone."""

    prefix: int
    by_node: dict[str, int]


class StoreReplicate(BaseModel):
    """Copy these keys from `source` into the receiving node (hot-block replication)."""

    keys: list[str]
    sizes: list[int]
    source: StoreLocation


class StoreReplicateReply(BaseModel):
    """How many keys the receiving node now holds."""

    copied: int
