"""The store pool's READY objects served by the transfer engine to GETs by key.

A reader that knows a key fetches the object in one round trip (the engine looks the key up,
pins the bytes while it sends them) instead of asking the control channel for a lease and the
offset first. The object table stays the one truth: it publishes an object when it becomes READY
and retires it before its bytes are freed (see `ObjectTable`).
"""

from __future__ import annotations

from mooncake_server.transfer import TransferEngine, TransferError


class EngineKeyedReads:
    """`KeyedReads` over the engine that serves the pool segment `segment`."""

    def __init__(self, engine: TransferEngine, segment: str) -> None:
        """Publish objects of `segment`."""
        self._engine = engine
        self._segment = segment

    def publish(self, key: str, tag: int, offset: int, size: int, checksum: int) -> None:
        """Serve the object at `offset` to GETs of `key`."""
        self._engine.publish(key, self._segment, offset, size, checksum, tag)

    def retire(self, key: str, tag: int) -> bool:
        """Stop serving it; True when its bytes may be reused now."""
        try:
            return self._engine.retire(key, tag)
        except TransferError:
            return True  # the engine is closed: it serves nothing any more

    def take_drained(self) -> list[int]:
        """Tags of retired objects whose last GET finished."""
        try:
            return self._engine.take_drained()
        except TransferError:
            return []

    def take_touched(self) -> list[tuple[str, int]]:
        """(key, GETs) served since the last call."""
        try:
            return self._engine.take_touched()
        except TransferError:
            return []
