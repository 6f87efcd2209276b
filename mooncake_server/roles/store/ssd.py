"""The SSD tier of one store node: objects as files (aiofiles), its own LRU, kept across restarts.

An object walks:
  demoted (`write`: idle in DRAM, bytes written from the pool while pinned; or `stage`: evicted
  from DRAM, bytes copied out and written in the background, served from that copy meanwhile)
  -> on SSD (visible to `contains`, LRU-ordered) -> read back into DRAM by `read_into` (rehydrate;
  the file stays, so a later DRAM eviction costs nothing) -> SSD LRU eviction when full, `remove`.

One file per object, `<sha256(key)[:32]>-<generation>.blk`: a fixed header (magic, version, key
length, size, CRC32C) then the key then the bytes. Files are written under a `.tmp` name and
renamed when complete, so a crash leaves no half object; the headers are the on-disk index that
`open()` scans at start-up (LRU order from the files' modification times).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiofiles  # type: ignore[import-untyped]
import aiofiles.os  # type: ignore[import-untyped]

logger = logging.getLogger(__name__)

_MAGIC = b"MCSD"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQI")  # magic, version, key length, size, crc32c
_SUFFIX = ".blk"


class SsdError(RuntimeError):
    """An SSD object could not be read back (missing, truncated or unreadable file)."""


@dataclass(slots=True, eq=False)
class SsdEntry:
    """One object on the SSD tier."""

    key: str
    size: int
    checksum: int
    path: Path
    pending: bytes | None = None  # bytes still being written (served from here meanwhile)

    @property
    def data_offset(self) -> int:
        """Where the object's bytes start in its file."""
        return _HEADER.size + len(self.key.encode())

    @property
    def file_bytes(self) -> int:
        """Bytes the object takes on disk (header included)."""
        return self.data_offset + self.size


class SsdStats(NamedTuple):
    """Counters and gauges of the SSD tier."""

    objects: int
    bytes_used: int
    capacity: int
    pending_bytes: int
    evictions: int
    write_failures: int


class SsdTier:
    """Files in one directory, with an LRU bounded by `capacity` bytes."""

    def __init__(self, directory: str | Path, capacity: int, *,
                 max_pending_bytes: int = 256 << 20,
                 on_drop: Callable[[str], None] | None = None) -> None:
        """Use `directory` (created if missing); `on_drop(key)` hears of every object lost."""
        if capacity <= 0:
            raise ValueError(f"SSD capacity must be positive, got {capacity}")
        self._dir = Path(directory)
        self._capacity = capacity
        self._max_pending = max_pending_bytes
        self.on_drop = on_drop  # settable later: the node wires itself in
        self._lru: OrderedDict[str, SsdEntry] = OrderedDict()
        self._used = 0
        self._pending = 0
        self._evictions = 0
        self._write_failures = 0
        self._gen = itertools.count(int(time.time() * 1000))
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def directory(self) -> Path:
        """Where the files live."""
        return self._dir

    async def open(self) -> int:
        """Create the directory and load the objects a previous run left; return how many."""
        entries = await asyncio.to_thread(_scan, self._dir)
        for entry in entries:
            if entry.key in self._lru:  # an older copy of a re-written key: keep the newest
                self._forget(self._lru[entry.key], delete=True)
            self._lru[entry.key] = entry
            self._used += entry.file_bytes
        self._make_room(0)
        logger.info("SSD tier %s: %d objects, %d bytes", self._dir, len(self._lru), self._used)
        return len(self._lru)

    async def close(self) -> None:
        """Wait for background writes to finish (their files then survive a restart)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- queries ------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """True when `key` is on this tier (written or being written)."""
        return key in self._lru

    def entry(self, key: str) -> SsdEntry | None:
        """The entry of `key`, if any."""
        return self._lru.get(key)

    def entries(self) -> list[SsdEntry]:
        """Every object on the tier, least recently used first."""
        return list(self._lru.values())

    def stats(self) -> SsdStats:
        """Counters and gauges for /metrics."""
        return SsdStats(len(self._lru), self._used, self._capacity, self._pending,
                        self._evictions, self._write_failures)

    # ---- writes -------------------------------------------------------------------------------

    async def write(self, key: str, data: memoryview | bytes, checksum: int) -> bool:
        """Write an object now (the caller keeps `data` stable until this returns)."""
        size = len(data)
        if key in self._lru or not self._fits(key, size):
            return key in self._lru
        path = self._new_path(key)
        try:
            await _write_file(path, key, data, checksum)
        except OSError as exc:
            self._write_failures += 1
            logger.warning("SSD write of %s failed: %s", key, exc)
            return False
        if key in self._lru:  # staged by someone else meanwhile: ours is redundant
            await _unlink_quietly(path)
            return True
        self._insert(SsdEntry(key, size, checksum, path))
        return True

    def stage(self, key: str, data: bytes, checksum: int) -> bool:
        """Take a copy of an object leaving DRAM and write it in the background; False = dropped."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return True
        if not self._fits(key, len(data)) or self._pending + len(data) > self._max_pending:
            return False
        entry = SsdEntry(key, len(data), checksum, self._new_path(key), pending=data)
        self._insert(entry)
        self._pending += len(data)
        task = asyncio.get_running_loop().create_task(self._finish_stage(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def remove(self, key: str) -> bool:
        """Drop `key` from the tier (its file goes in the background); False if absent."""
        entry = self._lru.get(key)
        if entry is None:
            return False
        self._forget(entry, delete=True)
        return True

    # ---- reads --------------------------------------------------------------------------------

    async def read_into(self, key: str, dest: memoryview) -> SsdEntry:
        """Copy the object's bytes into `dest` (exactly its size); raise SsdError if lost."""
        entry = self._lru.get(key)
        if entry is None:
            raise SsdError(f"{key} is not on the SSD tier")
        if len(dest) != entry.size:
            raise ValueError(f"read_into: {key} is {entry.size} bytes, buffer is {len(dest)}")
        self._lru.move_to_end(key)
        if entry.pending is not None:
            dest[:] = entry.pending
            return entry
        try:
            async with aiofiles.open(entry.path, "rb", buffering=0) as f:
                await f.seek(entry.data_offset)
                got = 0
                while got < entry.size:
                    n = await f.readinto(dest[got:])
                    if not n:
                        break
                    got += n
        except OSError as exc:
            self._forget_lost(entry)
            raise SsdError(f"reading {key} from {entry.path} failed: {exc}") from exc
        if got != entry.size:
            self._forget_lost(entry)
            raise SsdError(f"{entry.path} is truncated: {got} of {entry.size} bytes")
        return entry

    # ---- internals ----------------------------------------------------------------------------

    def _fits(self, key: str, size: int) -> bool:
        return _HEADER.size + len(key.encode()) + size <= self._capacity

    def _make_room(self, need: int) -> None:
        while self._lru and self._used + need > self._capacity:
            _, victim = next(iter(self._lru.items()))
            self._evictions += 1
            self._forget(victim, delete=True)
            if self.on_drop is not None:
                self.on_drop(victim.key)

    def _insert(self, entry: SsdEntry) -> None:
        # The newest entry is at the LRU's tail and fits alone, so making room never drops it.
        self._lru[entry.key] = entry
        self._used += entry.file_bytes
        self._make_room(0)

    def _forget(self, entry: SsdEntry, *, delete: bool) -> None:
        if self._lru.get(entry.key) is entry:
            del self._lru[entry.key]
            self._used -= entry.file_bytes
        if entry.pending is None and delete:
            # A pending entry has no file yet; its writer sees it is gone and drops its file.
            self._spawn(_unlink_quietly(entry.path))

    def _forget_lost(self, entry: SsdEntry) -> None:
        self._forget(entry, delete=True)
        if self.on_drop is not None:
            self.on_drop(entry.key)

    async def _finish_stage(self, entry: SsdEntry) -> None:
        data = entry.pending
        if data is None:
            return
        try:
            await _write_file(entry.path, entry.key, data, entry.checksum)
        except OSError as exc:
            self._write_failures += 1
            logger.warning("SSD write of %s failed: %s", entry.key, exc)
            entry.pending = None
            self._pending -= len(data)
            if self._lru.get(entry.key) is entry:
                self._forget(entry, delete=False)
                if self.on_drop is not None:
                    self.on_drop(entry.key)
            return
        entry.pending = None
        self._pending -= len(data)
        if self._lru.get(entry.key) is not entry:
            await _unlink_quietly(entry.path)  # removed or evicted while it was being written

    def _new_path(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return self._dir / f"{digest}-{next(self._gen)}{_SUFFIX}"

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _write_file(path: Path, key: str, data: memoryview | bytes, checksum: int) -> None:
    """Write header + key + bytes under a temporary name, then rename into place."""
    raw_key = key.encode()
    header = _HEADER.pack(_MAGIC, _VERSION, len(raw_key), len(data), checksum) + raw_key
    tmp = path.with_suffix(".tmp")
    try:
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(header)
            await f.write(data)
        await aiofiles.os.replace(tmp, path)
    except BaseException:
        await _unlink_quietly(tmp)
        raise


async def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        await aiofiles.os.remove(path)


def _scan(directory: Path) -> list[SsdEntry]:
    """Read every object header of a directory (blocking; runs in a thread), oldest first."""
    directory.mkdir(parents=True, exist_ok=True)
    found: list[tuple[float, SsdEntry]] = []
    for item in os.scandir(directory):
        path = Path(item.path)
        if item.name.endswith(".tmp"):
            path.unlink(missing_ok=True)  # a write a crash interrupted
            continue
        if not item.name.endswith(_SUFFIX):
            continue
        try:
            st = item.stat()
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                magic, version, key_len, size, checksum = _HEADER.unpack(head)
                key = f.read(key_len).decode()
            if magic != _MAGIC or version != _VERSION or len(key.encode()) != key_len:
                raise ValueError("bad header")
            if st.st_size != _HEADER.size + key_len + size:
                raise ValueError(f"size {st.st_size} does not match its header")
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
            logger.warning("SSD tier: dropping unreadable %s (%s)", path, exc)
            path.unlink(missing_ok=True)
            continue
        found.append((st.st_mtime, SsdEntry(key, size, checksum, path)))
    found.sort(key=lambda pair: pair[0])
    return [entry for _, entry in found]
