"""The global store index channel: store nodes, engine roles and store clients <-> the store master
(its own process with `--role master`, or inside the conductor).
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field

from mooncake_server.wire.instances import StoreLocation

# Global store index (store nodes and engine roles <-> the conductor's store master).

class IndexOp(enum.IntEnum):
    """RPC op codes of the index's binary channel."""

    REPORT = 1
    LOCATE = 2  # the client calls: the same bodies as their HTTP routes (store_client.IndexLink)
    PLACE = 3
    COMMITTED = 4
    DROP = 5


TIER_DRAM = "dram"
TIER_SSD = "ssd"


# Mooncake's ErrorCode values where the master decides them (mooncake_api keeps the full set).
NOT_FOUND = -704
HAS_LEASE = -706


class StoreLocate(BaseModel):
    """Where are these keys? `fallback`: name the ring targets of keys the index lacks yet.
    `lease`: keys found are leased for the master's lease time (a remove without force is
    refused meanwhile), as a read through Mooncake's master is."""

    keys: list[str]
    fallback: bool = True
    lease: bool = False


class StorePlace(BaseModel):
    """Where should new keys go: `replicas` copies each (None: the master's --replicas),
    on the `preferred` nodes (ids or transfer addresses) first."""

    keys: list[str]
    replicas: int | None = Field(default=None, ge=1, le=16)
    preferred: list[str] = Field(default_factory=list)
    skip_existing: bool = False  # keys the index holds get no targets (write-once puts)


class StoreCommitted(BaseModel):
    """A client's put_end was answered: index these keys on `node_id` now, before the node's
    own (coalesced) report, so the writer's next call finds them."""

    node_id: str
    keys: list[str]
    sizes: list[int]


class StoreDrop(BaseModel):
    """Take keys out of the index before their nodes are told (a client's remove): the
    named `keys`, those matching `regex`, or `all`; leased keys stay unless `force`."""

    keys: list[str] = Field(default_factory=list)
    regex: str | None = None
    all: bool = False
    force: bool = False


class StoreDropReply(BaseModel):
    """Per key considered: 0 (dropped: remove it from `holders`), NOT_FOUND or HAS_LEASE."""

    keys: list[str]
    codes: list[int]
    holders: list[list[str]]
    nodes: dict[str, StoreLocation]


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
    """Per key, its live replicas (DRAM copies first) and size (None: not indexed); `nodes`
    says how to reach each node."""

    nodes: dict[str, StoreLocation]
    replicas: list[list[StoreReplica]]
    sizes: list[int | None] = Field(default_factory=list)
    channel: str | None = None  # host:port of the index's binary channel: later calls go there


class StorePlaceReply(BaseModel):
    """Per key, the store nodes that should hold it (consistent hashing over live nodes);
    with `skip_existing`, `existing` marks keys already held (no targets)."""

    nodes: dict[str, StoreLocation]
    targets: list[list[str]]
    existing: list[bool] = Field(default_factory=list)
    channel: str | None = None  # as StoreLocateReply's


class StorePrefixReply(BaseModel):
    """Longest cached prefix over all live nodes together, and on each node alone."""

    prefix: int
    by_node: dict[str, int]
    urls: dict[str, str] = Field(default_factory=dict)  # node id -> its URL (which host)


class StoreReplicate(BaseModel):
    """Copy these keys from `source` into the receiving node (hot-block replication)."""

    keys: list[str]
    sizes: list[int]
    source: StoreLocation


class StoreReplicateReply(BaseModel):
    """How many keys the receiving node now holds."""

    copied: int
