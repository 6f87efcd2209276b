"""Typed messages between roles, one place, one codec (pydantic JSON over HTTP).

Bulk KV bytes never travel in these messages: they move through the transfer engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# NOTE: every internal HTTP request carries the cluster secret in this header.
SECRET_HEADER = "X-Mooncake-Secret"


# What a prefill may reuse: its local cache only, local + the store, or nothing (recompute).
Reuse = Literal["local", "global", "none"]

class SamplingParams(BaseModel):
    """How to pick the next token; temperature 0 means greedy."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    eos_token_ids: list[int] = Field(default_factory=list)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0


# ---------------------------------------------------------------------------------------------
# Registry (every role -> conductor)


class InstanceInfo(BaseModel):
    """What an instance tells the conductor about itself when it registers."""

    instance_id: str
    role: str  # prefill | decode | store
    url: str  # HTTP base URL of its internal API
    transfer_address: str | None = None  # host:port of its transfer engine, if it serves one
    segment: str | None = None  # name of the registered memory segment others may access
    model: str | None = None
    control_address: str | None = None  # store: host:port of its binary control channel
    # New with every process start: a restarted instance is measured afresh, not judged by the
    # calibration its previous process earned.
    incarnation: str | None = None


class Heartbeat(BaseModel):
    """Periodic liveness and load report."""

    instance_id: str
    running: int = 0
    waiting: int = 0
    free_blocks: int | None = None


class StoreLocation(BaseModel):
    """Where a store node's control API and data segment live."""

    instance_id: str
    url: str
    transfer_address: str
    segment: str
    control_address: str | None = None  # binary control channel; None = HTTP at `url` only

    @classmethod
    def of(cls, info: InstanceInfo) -> StoreLocation | None:
        """The location a registered store instance advertised (None if it serves no segment)."""
        if not info.transfer_address or not info.segment:
            return None
        return cls(instance_id=info.instance_id, url=info.url,
                   transfer_address=info.transfer_address, segment=info.segment,
                   control_address=info.control_address)


# ---------------------------------------------------------------------------------------------
# Conductor -> prefill


class PrefillJob(BaseModel):
    """Prefill this prompt: reuse cached prefix blocks, compute the rest, store new blocks."""

    request_id: str
    prompt_token_ids: list[int]
    block_keys: list[str]  # chained keys of the prompt's full blocks
    sampling: SamplingParams
    store: StoreLocation
    # Which cached prefix the instance may reuse (the conductor's policy decides):
    # "local" = only blocks in its own paged pool, "global" = also fetch the rest of the cached
    # prefix from the store, "none" = compute every token.
    reuse: Reuse = "global"


class PrefillResult(BaseModel):
    """Outcome of a prefill: the first output token and where the prompt's KV now lives."""

    request_id: str
    first_token: int
    cached_tokens: int  # prompt tokens whose KV came from the store instead of compute
    tail_key: str | None  # store key of the partial last block (None if the prompt fills blocks)
    block_checksums: list[int]  # CRC32C of each full block, then the tail, in key order
    prefill_seconds: float
    local_cached_tokens: int = 0  # of cached_tokens, those found in the instance's own cache


class PrefillCacheReport(BaseModel):
    """A prefill instance's local prefix cache: changes since its last report, or everything."""

    instance_id: str
    epoch: str  # new each time the instance starts: its old state is void
    seq: int = Field(ge=0)
    snapshot: bool = False
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)


class PrefillCacheReportReply(BaseModel):
    """resync = the conductor does not know this epoch (or missed a report): send a snapshot."""

    accepted: bool
    resync: bool = False


# ---------------------------------------------------------------------------------------------
# Conductor -> decode


class DecodeJob(BaseModel):
    """Load the prompt's KV from the store and decode, streaming tokens back."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    block_keys: list[str]
    tail_key: str | None
    block_checksums: list[int]
    sampling: SamplingParams
    store: StoreLocation
    # A moved request (migration): output tokens after `first_token` the client already has;
    # `block_keys` then names every full block of the computed tokens, not only the prompt's.
    generated_token_ids: list[int] = Field(default_factory=list)
    # Namespace of the chained keys, so the decode instance can key the blocks it writes back.
    kv_namespace: str | None = None


class DecodeReserve(BaseModel):
    """Ask a decode instance, before prefill starts, to hold room for a request (admission)."""

    request_id: str
    prompt_tokens: int = Field(ge=0)
    max_tokens: int = Field(ge=1)


class DecodeReserveReply(BaseModel):
    """The request is admitted; its decode job must arrive within `ttl_s`."""

    ttl_s: float


class DecodeRelease(BaseModel):
    """Drop a reservation whose decode job will not come (the request ended at prefill)."""

    request_id: str


class DecodeEvent(BaseModel):
    """One line of the decode stream (NDJSON): a token, and the reason if it is the last."""

    token_id: int
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    batch_size: int = 1  # size of the forward pass that produced it
    # Position of the token in the output (the prefill's first token is 0): the conductor drops
    # a token it already passed on, so a moved request never repeats one.
    index: int | None = None


class ErrorEvent(BaseModel):
    """A decode stream line reporting a failure instead of a token."""

    error: str


# ---------------------------------------------------------------------------------------------
# Store control plane (prefill / decode -> store). Offsets are into the store's registered segment.


class StoreKeys(BaseModel):
    """A batch of block keys (put_abort, exists, remove)."""

    keys: list[str]


class StorePutStart(BaseModel):
    """Reserve space for these keys (state WRITING) before writing their bytes."""

    keys: list[str]
    sizes: list[int]


class StorePutStartReply(BaseModel):
    """Where to write each key: None = skip it (already present, being written, or refused)."""

    offsets: list[int | None]
    refused: list[str] = Field(default_factory=list)  # keys that did not fit even after eviction


class StorePutEnd(BaseModel):
    """The bytes of these keys are written: make them READY with their CRC32C."""

    keys: list[str]
    checksums: list[int]


class StorePutEndReply(BaseModel):
    """Per key whether it is now READY in the store."""

    committed: list[bool]


class StoreGet(BaseModel):
    """Pin the leading present keys under a lease and say where their bytes are."""

    keys: list[str]
    lease_s: float | None = Field(default=None, gt=0.0, le=3600.0)  # None = the store's default
    sparse: bool = False  # pin every present key, not only the leading run


class StoreGetReply(BaseModel):
    """The leading `found` keys, pinned under `lease_id` (None when found == 0).

    In a sparse get, `present` flags the requested keys that were found and the lists describe
    those keys in request order.
    """

    lease_id: str | None
    found: int
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    present: list[bool] = Field(default_factory=list)


class StoreLocate(BaseModel):
    """Where are these keys? `fallback`: name the ring targets of keys the index lacks yet."""

    keys: list[str]
    fallback: bool = True


class StoreRelease(BaseModel):
    """Unpin a lease taken by a get."""

    lease_id: str


class StoreReleaseReply(BaseModel):
    """False when the lease was unknown (already released or expired)."""

    released: bool


class StoreExistsReply(BaseModel):
    """Per key presence, and how many leading keys are present."""

    exists: list[bool]
    prefix: int


class StoreRemoveReply(BaseModel):
    """How many of the keys were known to the store."""

    removed: int


# ---------------------------------------------------------------------------------------------
# Registry replies (conductor -> instances and operators). Owned by the conductor's registry.


class InstanceStatus(BaseModel):
    """One registered instance as the conductor sees it (GET /internal/instances)."""

    info: InstanceInfo
    alive: bool
    seconds_since_heartbeat: float
    load: Heartbeat | None = None
    draining: bool = False  # finishing its work after SIGTERM: never picked for new work


class Deregister(BaseModel):
    """An instance leaving on purpose (graceful shutdown): stop routing to it now."""

    instance_id: str


class Drain(BaseModel):
    """An instance got SIGTERM: send it no new work; it finishes what it runs, then leaves."""

    instance_id: str


# ---------------------------------------------------------------------------------------------
# Request migration (operators / policies -> conductor)


class MigrateRequest(BaseModel):
    """Move a decoding request to another decode instance (`target`, or the least loaded)."""

    request_id: str
    target: str | None = None


class MigrateReply(BaseModel):
    """The move was ordered: the request leaves `source` for `target` at its next token."""

    request_id: str
    source: str
    target: str


class RunningRequest(BaseModel):
    """A request the conductor is serving (GET /internal/requests)."""

    request_id: str
    phase: str  # "prefill" | "decode"
    instance_id: str  # the prefill or decode instance serving it now
    tokens: int  # output tokens passed to the client so far
    moves: int  # times it moved to another instance (failures and migrations)


# ---------------------------------------------------------------------------------------------
# Global store index (store nodes and engine roles <-> the conductor's store master).

TIER_DRAM = "dram"
TIER_SSD = "ssd"


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
