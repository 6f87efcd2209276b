"""Request migration: operators and policies -> the conductor.
"""

from __future__ import annotations

from pydantic import BaseModel

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
