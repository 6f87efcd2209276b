"""The SSD tier: files written with aiofiles, its own LRU, reloaded after a restart."""

from __future__ import annotations

import os
from pathlib import Path

from mooncake_server.roles.store.ssd import SsdTier


async def test_write_read_back_and_reload_after_restart(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, 1 << 20)
    assert await ssd.open() == 0
    blobs = {f"key-{i}": os.urandom(1000 + i) for i in range(5)}
    for key, data in blobs.items():
        assert await ssd.write(key, memoryview(data), checksum=len(data))
    out = bytearray(1002)
    entry = await ssd.read_into("key-2", memoryview(out))
    assert bytes(out) == blobs["key-2"] and entry.checksum == 1002
    await ssd.close()

    again = SsdTier(tmp_path, 1 << 20)
    assert await again.open() == 5  # the files are the on-disk index
    for key, data in blobs.items():
        buf = bytearray(len(data))
        assert (await again.read_into(key, memoryview(buf))).checksum == len(data)
        assert bytes(buf) == data


async def test_staged_copy_is_readable_before_and_after_it_lands(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, 1 << 20)
    await ssd.open()
    data = os.urandom(4096)
    assert ssd.stage("k", data, 7)
    assert ssd.contains("k") and ssd.stats().pending_bytes == 4096
    buf = bytearray(4096)
    await ssd.read_into("k", memoryview(buf))
    assert bytes(buf) == data
    await ssd.close()
    assert ssd.stats().pending_bytes == 0 and len(list(tmp_path.glob("*.blk"))) == 1
    buf[:] = bytes(4096)
    await ssd.read_into("k", memoryview(buf))
    assert bytes(buf) == data


async def test_full_tier_evicts_least_recently_used(tmp_path: Path) -> None:
    dropped: list[str] = []
    ssd = SsdTier(tmp_path, 3 * 1100, on_drop=dropped.append)  # room for 3 objects + headers
    await ssd.open()
    for key in ("a", "b", "c"):
        assert await ssd.write(key, b"x" * 1000, 0)
    await ssd.read_into("a", memoryview(bytearray(1000)))  # a becomes most recent
    assert await ssd.write("d", b"y" * 1000, 0)
    assert dropped == ["b"] and not ssd.contains("b") and ssd.contains("a")
    assert ssd.stats().evictions == 1 and ssd.stats().bytes_used <= 3 * 1100
    assert not await ssd.write("huge", b"z" * 5000, 0)  # larger than the tier: refused
    await ssd.close()
    assert len(list(tmp_path.glob("*.blk"))) == 3


async def test_damaged_files_are_dropped_on_open(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, 1 << 20)
    await ssd.open()
    await ssd.write("good", b"g" * 100, 1)
    await ssd.write("cut", b"c" * 100, 2)
    await ssd.close()
    victim = ssd.entry("cut").path  # type: ignore[union-attr]
    victim.write_bytes(victim.read_bytes()[:-10])
    (tmp_path / "leftover.tmp").write_bytes(b"half a write")
    again = SsdTier(tmp_path, 1 << 20)
    assert await again.open() == 1 and again.contains("good") and not again.contains("cut")
    assert not victim.exists() and not (tmp_path / "leftover.tmp").exists()
    again.remove("good")
    await again.close()
    assert list(tmp_path.iterdir()) == []
