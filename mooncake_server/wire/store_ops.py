"""A store node's control plane (prefill / decode -> store, over RPC or HTTP).

Offsets are into the store node's registered segment; block bytes never travel here: they
move through the transfer engine.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field


class StoreOp(enum.IntEnum):
    """The store's control calls: RPC op codes, and the names of their HTTP routes."""

    PUT_START = 1
    PUT_END = 2
    PUT_ABORT = 3
    GET = 4
    RELEASE = 5
    EXISTS = 6
    REMOVE = 7


class StoreKeys(BaseModel):
    """A batch of block keys (put_abort, exists, remove)."""

    keys: list[str]
    # put_abort only: free just this writer's reservations, and refuse its put_start if that
    # arrives later (a put_start whose answer never came may still be on the wire).
    writer: str | None = None


class StorePutStart(BaseModel):
    """Reserve space for these keys (state WRITING) before writing their bytes."""

    keys: list[str]
    sizes: list[int]
    writer: str | None = None  # the writer's token for put_abort (see StoreKeys)
    # Mooncake's pins: 0 none, > 0 a soft pin's TTL (evicted last; renewed by reads), -1 hard
    # (never evicted). roles/store/eviction.py.
    pin_ms: int = Field(default=0, ge=-1)


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
