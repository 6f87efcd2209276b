"""The small types of Mooncake's store API: error codes, `ReplicateConfig`, `SoftPinAction`,
`BufferHandle`, with the real wheel's names, fields and values."""

from __future__ import annotations

import ctypes
import enum


class ErrorCode(enum.IntEnum):
    """Mooncake's return codes (negative on failure), as its store client returns them."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = -200  # no space: nothing could be allocated for the value
    INVALID_PARAMS = -600
    INVALID_READ = -701
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    UNAVAILABLE_IN_CURRENT_STATUS = -1010  # the client is not set up (or closed)


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin (Mooncake 0.3.13's names and values; a soft
    pinned object is evicted only when nothing unpinned can make room)."""

    PRESERVE = 0  # keep the pin the object has (a new object: none)
    ENABLE = 1
    DISABLE = 2


# mooncake_master's --default_kv_soft_pin_ttl and --max_kv_soft_pin_ttl (ms).
DEFAULT_SOFT_PIN_TTL_MS = 1_800_000
MAX_SOFT_PIN_TTL_MS = 86_400_000


class ReplicateConfig:
    """Per-put placement: `replica_num` copies, on `preferred_segment(s)` first (a segment is a
    store node: its id or transfer address, Mooncake's "host:port"), and Mooncake's pins."""

    def __init__(self) -> None:
        """Mooncake's defaults: one replica, no preference, no pin."""
        self.replica_num = 1
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.with_hard_pin = False
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None  # None: the master's default (30 min)

    @property
    def with_soft_pin(self) -> bool:
        """Older Mooncake's switch for a soft pin (soft_pin_action ENABLE)."""
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    def pin_ms(self) -> int:
        """The pin a put asks the store node for: -1 hard, a soft pin's TTL in ms, or 0."""
        if self.with_hard_pin:
            return -1
        if self.soft_pin_action != SoftPinAction.ENABLE:
            return 0
        ttl = DEFAULT_SOFT_PIN_TTL_MS if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return max(1, min(int(ttl), MAX_SOFT_PIN_TTL_MS))

    def preferred(self) -> list[str]:
        """Every preferred segment, in order."""
        out = [self.preferred_segment] if self.preferred_segment else []
        return out + [s for s in self.preferred_segments if s and s not in out]

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, preferred="
                f"{self.preferred()!r}, soft_pin={self.soft_pin_action.name}, "
                f"hard_pin={self.with_hard_pin})")


class BufferHandle(bytearray):
    """Bytes of one object read into memory this client owns (`get_buffer`); a buffer object
    as the real one is (`bytes(h)`, `memoryview(h)`), with its address and size."""

    def ptr(self) -> int:
        """Address of the bytes."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        """Their length."""
        return len(self)

    def tobytes(self) -> bytes:
        """A copy of the bytes."""
        return bytes(self)
