"""Consistent hashing of block keys over store nodes.

Each node owns `vnodes` points on a 64-bit ring; a key's replicas are the first `k` distinct nodes
clockwise from the key's own point. Adding or removing one node moves only the keys next to its
points (about 1/N of them), so a node dying does not reshuffle where everything else lives.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from hashlib import blake2b

DEFAULT_VNODES = 64


def _point(data: str) -> int:
    return int.from_bytes(blake2b(data.encode(), digest_size=8).digest(), "little")


class HashRing:
    """An immutable ring over a set of node ids."""

    def __init__(self, nodes: Iterable[str], vnodes: int = DEFAULT_VNODES) -> None:
        """Place `vnodes` points per node (node ids must be unique)."""
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        self.nodes = tuple(sorted(set(nodes)))
        pairs = sorted((_point(f"{node}#{i}"), node) for node in self.nodes for i in range(vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [n for _, n in pairs]

    def targets(self, key: str, k: int) -> list[str]:
        """The `k` nodes (fewer if the ring has fewer) that hold `key`, primary first."""
        if k < 1:
            raise ValueError(f"replica count must be at least 1, got {k}")
        want = min(k, len(self.nodes))
        if want == 0:
            return []
        found: list[str] = []
        i = bisect.bisect_right(self._points, _point(key))
        n = len(self._points)
        for step in range(n):
            node = self._owners[(i + step) % n]
            if node not in found:
                found.append(node)
                if len(found) == want:
                    break
        return found
