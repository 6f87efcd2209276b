"""EvictionOrder: the objects a store node may evict, in the order it evicts them, with
Mooncake's pins.

Mooncake's `ReplicateConfig` lets a writer pin what it puts: a soft pin (`soft_pin_action`
ENABLE, `soft_pin_ttl_ms`, default 30 min) keeps an object out of eviction while anything
unpinned can go instead, and lasts `ttl` after the object's last write or read; a hard pin
(`with_hard_pin`) keeps it until it is removed. Eviction here takes, least recently used first:
unpinned objects and soft pins that ran out, then (only to make room for a put, not to get under
the high watermark) soft-pinned ones. Hard-pinned objects never enter the order.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mooncake_server.roles.store.allocator import align_up

if TYPE_CHECKING:
    from mooncake_server.roles.store.objects import StoreObject

HARD_PIN = math.inf  # a StoreObject's pin_s for a hard pin


def pin_seconds(pin_ms: int) -> float:
    """A put's pin (ms, 0 none, -1 hard) as a StoreObject's pin_s."""
    if pin_ms < -1:
        raise ValueError(f"pin_ms must be -1 (hard pin), 0 (none) or a TTL in ms, got {pin_ms}")
    return HARD_PIN if pin_ms == -1 else pin_ms / 1000.0


class EvictionOrder:
    """READY, unleased, not-removed objects that are not hard-pinned: unpinned ones and soft
    pinned ones, each in least-recently-used order."""

    def __init__(self, clock: Callable[[], float]) -> None:
        """`clock` dates soft pins (the table's clock)."""
        self._clock = clock
        self._plain: OrderedDict[str, StoreObject] = OrderedDict()
        self._soft: OrderedDict[str, StoreObject] = OrderedDict()
        self.bytes = 0  # aligned bytes of every object in the order

    def __bool__(self) -> bool:
        return bool(self._plain or self._soft)

    def __contains__(self, key: str) -> bool:
        return key in self._plain or key in self._soft

    def add(self, obj: StoreObject) -> None:
        """Enter as most recently used (a soft pin renewed); a hard-pinned object does not."""
        if obj.pin_s == HARD_PIN:
            return
        if obj.pin_s > 0:
            obj.pinned_until = self._clock() + obj.pin_s
            self._soft[obj.key] = obj
        else:
            self._plain[obj.key] = obj
        self.bytes += align_up(obj.size)

    def discard(self, obj: StoreObject) -> None:
        """Leave the order (leased, removed, evicted); nothing if it was not in it."""
        if (self._plain.pop(obj.key, None) or self._soft.pop(obj.key, None)) is not None:
            self.bytes -= align_up(obj.size)

    def touch(self, key: str) -> None:
        """A read or a repeated put: most recently used, its soft pin renewed."""
        if key in self._plain:
            self._plain.move_to_end(key)
        elif key in self._soft:
            self._soft.move_to_end(key)
            obj = self._soft[key]
            obj.pinned_until = self._clock() + obj.pin_s

    def next_victim(self, for_space: bool) -> StoreObject | None:
        """What eviction takes next: an ended soft pin or the oldest unpinned object; with
        `for_space` (a put needs room) a soft-pinned one when nothing else is left."""
        if self._soft:
            oldest = next(iter(self._soft.values()))
            if oldest.pinned_until <= self._clock():
                return oldest
        if self._plain:
            return next(iter(self._plain.values()))
        if for_space and self._soft:
            return next(iter(self._soft.values()))
        return None

    def unpinned(self) -> Iterator[StoreObject]:
        """Unpinned objects, least recently used first (what may leave for the SSD tier)."""
        return iter(self._plain.values())

    def unpinned_object(self, key: str) -> StoreObject | None:
        """The unpinned object under `key`, if it is in the order."""
        return self._plain.get(key)

    def soft_pinned(self) -> int:
        """How many soft-pinned objects are in the order."""
        return len(self._soft)
