"""A prefill instance's local prefix cache: full prompt blocks kept in its paged pool after a job.

A block walks: allocated to a job -> computed (or read from the store) -> `insert`ed under its
chained block key (the key names the whole prefix up to it, so a key hit means the block's KV is
exactly right for any prompt with that prefix) -> `release`d by the job: unreferenced, it sits at
the LRU end -> `match`ed by a later job (referenced again, out of the LRU) or evicted when
`allocate` needs room (its key is forgotten). Blocks in use by a job are never evicted.
Every key added or evicted is recorded, so the instance can report its cache to the conductor as
deltas (`take_changes`), or whole (`keys`).
"""

from __future__ import annotations

from collections import OrderedDict

from mooncake_server.engine.kv_cache import OutOfBlocks, PagedKVCache


class LocalPrefixCache:
    """Ref-counted, LRU-evicted cache of full KV blocks keyed by chained block key."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self._block_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._refs: dict[int, int] = {}  # cached blocks only; uncached ones belong to one job
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._changes: dict[str, bool] = {}  # key -> present, net since the last take_changes
        self.evictions = 0

    # ---- jobs ---------------------------------------------------------------------------------

    def match(self, keys: list[str]) -> list[int]:
        """Blocks of the longest leading run of `keys` held here; each is referenced once more."""
        found: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._refs[block] += 1
            self._idle.pop(block, None)
        return found

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for a job, evicting least recently used idle blocks if the pool is short.

        Raises OutOfBlocks (taking nothing) when even evicting every idle block is not enough.
        """
        short = n - self.kv.num_free
        if short > len(self._idle):
            raise OutOfBlocks(f"need {n} KV blocks, {self.kv.num_free} free and "
                              f"{len(self._idle)} cached idle of {self.kv.num_blocks}")
        for _ in range(max(0, short)):
            block, _ = self._idle.popitem(last=False)
            self._forget(block)
            self.kv.free([block])
            self.evictions += 1
        return self.kv.allocate(n)

    def insert(self, keys: list[str], block_ids: list[int]) -> None:
        """Cache each job-held block under its key (the job keeps its reference until release).

        A key already cached under another block keeps that block; this one stays the job's.
        """
        for key, block in zip(keys, block_ids):
            if key in self._block_of or block in self._key_of:
                continue
            self._block_of[key] = block
            self._key_of[block] = key
            self._refs[block] = 1
            self._changes[key] = True

    def release(self, block_ids: list[int]) -> None:
        """A job is done with these blocks: cached ones become idle at 0 refs, others are freed."""
        loose: list[int] = []
        for block in block_ids:
            refs = self._refs.get(block)
            if refs is None:
                loose.append(block)
                continue
            self._refs[block] = refs - 1
            if refs == 1:
                self._idle[block] = None
        self.kv.free(loose)

    # ---- views --------------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        """Blocks held under a key."""
        return len(self._block_of)

    @property
    def num_available(self) -> int:
        """Blocks a job could get now (free + idle cached)."""
        return self.kv.num_free + len(self._idle)

    def keys(self) -> list[str]:
        """Every cached key (a full report)."""
        return list(self._block_of)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """(added, removed) keys since the last call, net of each other."""
        changes, self._changes = self._changes, {}
        return ([k for k, present in changes.items() if present],
                [k for k, present in changes.items() if not present])

    def restore_changes(self, added: list[str], removed: list[str]) -> None:
        """Put back changes a report could not deliver (newer changes win)."""
        for key in added:
            self._changes.setdefault(key, True)
        for key in removed:
            self._changes.setdefault(key, False)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        del self._refs[block]
        self._changes[key] = False
