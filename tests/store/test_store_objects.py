"""The store's object table: put lifecycle, LRU eviction, leases, refusal when full."""

from __future__ import annotations

import pytest

from mooncake_server.roles.store.objects import ObjectTable

BLOCK = 1024


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def put(table: ObjectTable, keys: list[str], size: int = BLOCK) -> list[bool]:
    """put_start + put_end, returning which keys were placed."""
    res = table.put_start(keys, [size] * len(keys))
    placed = [k for k, off in zip(keys, res.offsets) if off is not None]
    table.put_end(placed, [hash(k) & 0xFFFFFFFF for k in placed])
    return [off is not None for off in res.offsets]


def make(blocks: int = 10, **kw: object) -> tuple[ObjectTable, FakeClock]:
    clock = FakeClock()
    table = ObjectTable(BLOCK * blocks, high_watermark=1.0, clock=clock, **kw)  # type: ignore[arg-type]
    return table, clock


def test_put_then_exists_and_get() -> None:
    table, _ = make()
    res = table.put_start(["a", "b"], [100, 200])
    assert all(off is not None for off in res.offsets) and res.refused == []
    assert table.exists(["a", "b"]) == ([False, False], 0)  # WRITING is not visible yet
    assert table.put_end(["a", "b"], [11, 22]) == [True, True]
    assert table.exists(["a", "b", "c", "a"]) == ([True, True, False, True], 2)
    got = table.get(["a", "b", "c", "a"])
    assert got.lease_id is not None
    assert [(o.key, o.size, o.checksum) for o in got.objects] == [("a", 100, 11), ("b", 200, 22)]
    assert table.stats().hits == 2 and table.stats().misses == 2


def test_put_of_present_key_is_a_noop() -> None:
    table, _ = make()
    put(table, ["a"])
    used = table.stats().bytes_used
    res = table.put_start(["a", "b"], [BLOCK, BLOCK])
    assert res.offsets[0] is None and res.offsets[1] is not None and res.refused == []
    assert table.stats().bytes_used == used + BLOCK


def test_abort_frees_reservation() -> None:
    table, _ = make()
    table.put_start(["a"], [BLOCK])
    table.put_abort(["a"])
    assert table.stats().bytes_used == 0 and table.lookup("a") is None
    assert table.put_end(["a"], [1]) == [False]


def test_an_unanswered_put_start_aborted_by_its_writer_holds_nothing() -> None:
    """A writer whose put_start got no answer aborts its token: whether the put_start reaches
    the store before that abort or after it (a link coming back up delivers it late), no
    space stays reserved, and another writer's reservation of a key is left alone."""
    table, clock = make()
    table.put_start(["a", "b"], [BLOCK, BLOCK], writer="w1")  # arrived before the abort
    table.put_start(["c"], [BLOCK], writer="w2")
    assert table.put_abort(["a", "b", "c"], writer="w1") == 2
    assert table.stats().writing == 1 and table.lookup("c") is not None  # w2's: untouched
    table.put_start(["d"], [BLOCK], writer="w3")  # a writer that never aborts
    assert table.put_abort(["e"], writer="w4") == 0  # w4 aborts before its put_start arrives
    late = table.put_start(["e"], [BLOCK], writer="w4")
    assert late.offsets == [None] and table.lookup("e") is None
    assert table.put_end(["d"], [1]) == [True]
    clock.now += 3600  # the refusal ends with the write timeout: the token is forgotten
    assert table.put_start(["e"], [BLOCK], writer="w4").offsets[0] is not None


def test_lru_evicts_least_recently_used_first() -> None:
    table, _ = make(blocks=3)
    put(table, ["a", "b", "c"])
    lease = table.get(["a"]).lease_id  # touch a: b is now the oldest
    assert lease is not None and table.release(lease)
    assert put(table, ["d"]) == [True]
    assert table.exists(["a", "b", "c", "d"])[0] == [True, False, True, True]
    assert table.stats().evictions == 1


def test_high_watermark_evicts_ahead_of_need() -> None:
    clock = FakeClock()
    table = ObjectTable(BLOCK * 10, high_watermark=0.5, clock=clock)
    put(table, [f"k{i}" for i in range(8)])
    stats = table.stats()
    assert stats.bytes_used <= BLOCK * 5 and stats.evictions == 3
    assert table.exists(["k5", "k6", "k7"])[1] == 3  # the newest survive


def test_leased_objects_are_never_evicted() -> None:
    table, _ = make(blocks=4)
    put(table, ["a", "b", "c", "d"])
    got = table.get(["a", "b"])
    assert got.lease_id is not None
    assert put(table, ["e", "f"]) == [True, True]  # evicts c and d, not the leased a and b
    assert table.exists(["a", "b", "c", "d", "e", "f"])[0] == [True, True, False, False, True, True]
    for o in got.objects:
        assert table.lookup(o.key) is o


def test_refuse_when_full_of_leased_data() -> None:
    table, _ = make(blocks=2)
    put(table, ["a", "b"])
    lease = table.get(["a", "b"]).lease_id
    res = table.put_start(["c", "d"], [BLOCK, BLOCK])
    assert res.offsets == [None, None] and res.refused == ["c", "d"]
    assert table.stats().puts_refused == 2
    assert table.exists(["a", "b"])[1] == 2  # nothing was evicted in vain
    assert lease is not None and table.release(lease)
    assert put(table, ["c"]) == [True]


def test_oversized_put_is_refused_without_evicting() -> None:
    table, _ = make(blocks=4)
    put(table, ["a", "b"])
    res = table.put_start(["huge"], [BLOCK * 5])
    assert res.refused == ["huge"] and table.exists(["a", "b"])[1] == 2
    assert table.stats().evictions == 0


def test_writing_objects_are_never_evicted() -> None:
    table, _ = make(blocks=2)
    table.put_start(["w1", "w2"], [BLOCK, BLOCK])
    res = table.put_start(["x"], [BLOCK])
    assert res.refused == ["x"]
    assert table.put_end(["w1", "w2"], [1, 2]) == [True, True]


def test_expired_leases_are_reaped() -> None:
    table, clock = make(blocks=2)
    put(table, ["a", "b"])
    lease = table.get(["a", "b"], lease_s=5.0).lease_id
    assert table.stats().active_leases == 1
    clock.now += 4.9
    assert table.put_start(["c"], [BLOCK]).refused == ["c"]
    clock.now += 0.2
    assert table.reap() == 1
    assert table.stats().active_leases == 0
    assert lease is not None and table.release(lease) is False  # late release is harmless
    assert put(table, ["c"]) == [True]


def test_stale_write_reservation_is_reaped() -> None:
    table, clock = make(blocks=2, write_timeout_s=10.0)
    table.put_start(["a"], [BLOCK])
    clock.now += 11
    assert table.reap() == 1
    assert table.stats().bytes_used == 0 and table.put_end(["a"], [1]) == [False]


def test_remove_waits_for_lease_end() -> None:
    table, _ = make(blocks=4)
    put(table, ["a", "b"])
    lease = table.get(["a"]).lease_id
    assert table.remove(["a", "b", "zz"]) == 2
    assert table.exists(["a", "b"])[0] == [False, False]
    assert table.stats().bytes_used == BLOCK  # a's bytes stay while the reader holds them
    assert put(table, ["a"]) == [True]  # the key itself is free for a new put
    assert lease is not None and table.release(lease)
    assert table.stats().bytes_used == BLOCK  # old a freed, new a stays
    assert table.exists(["a"])[1] == 1


def test_remove_during_write_drops_it_at_put_end() -> None:
    table, _ = make()
    table.put_start(["a"], [BLOCK])
    table.remove(["a"])
    assert table.put_end(["a"], [1]) == [False]
    assert table.stats().bytes_used == 0 and table.exists(["a"])[1] == 0


def test_bad_arguments_raise() -> None:
    table, _ = make()
    with pytest.raises(ValueError):
        table.put_start(["a"], [1, 2])
    with pytest.raises(ValueError):
        table.put_start(["a"], [0])
    with pytest.raises(ValueError):
        table.put_end(["a"], [])
    with pytest.raises(ValueError):
        table.get(["a"], lease_s=0)


def test_exists_256_keys_is_fast() -> None:
    import time

    table = ObjectTable(1 << 30)
    keys = [f"key-{i:064x}" for i in range(256)]
    put(table, keys)
    start = time.perf_counter()
    for _ in range(100):
        flags, prefix = table.exists(keys)
    per_call = (time.perf_counter() - start) / 100
    assert prefix == 256 and all(flags)
    assert per_call < 1e-3


class FakeKeyedReads:
    """The engine's GET-by-key side as the table sees it; `sending` holds keys mid-send."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}  # key -> tag
        self.sending: set[str] = set()
        self.retired_busy: dict[str, int] = {}
        self.drained: list[int] = []
        self.touched: list[tuple[str, int]] = []

    def publish(self, key: str, tag: int, offset: int, size: int, checksum: int) -> None:
        self.served[key] = tag

    def retire(self, key: str, tag: int) -> bool:
        if self.served.get(key) == tag:
            del self.served[key]
            if key in self.sending:
                self.retired_busy[key] = tag
                return False
        return self.retired_busy.get(key) != tag

    def finish(self, key: str) -> None:
        self.sending.discard(key)
        if key in self.retired_busy:
            self.drained.append(self.retired_busy.pop(key))

    def take_drained(self) -> list[int]:
        out, self.drained = self.drained, []
        return out

    def take_touched(self) -> list[tuple[str, int]]:
        out, self.touched = self.touched, []
        return out


def test_bytes_a_get_by_key_still_sends_are_not_reused_until_it_is_done() -> None:
    keyed = FakeKeyedReads()
    table, _ = make(blocks=3, keyed=keyed)
    assert put(table, ["a", "b", "c"]) == [True] * 3
    assert set(keyed.served) == {"a", "b", "c"}  # READY objects are served by key
    offset_a = table.lookup("a").offset  # type: ignore[union-attr]
    keyed.sending.add("a")
    keyed.touched = [("b", 1)]  # b was read by key: now it is the most recently used
    assert put(table, ["d"]) == [True]
    # a (LRU) was evicted, but a GET still sends its bytes: they are not reusable, so the
    # next least recently used object (c, not the touched b) made room.
    assert table.lookup("a") is None and "a" not in keyed.served
    assert table.lookup("b") is not None and table.lookup("c") is None
    assert table.stats().draining_bytes == BLOCK
    assert put(table, ["e"]) == [True]
    assert table.lookup("e").offset != offset_a  # type: ignore[union-attr]
    keyed.finish("a")
    assert table.stats().draining_bytes == 0  # drained: the space is free again
    assert put(table, ["f"]) == [True]
    assert table.lookup("f").offset == offset_a  # type: ignore[union-attr]
    assert table.lookup("d") is not None and table.lookup("e") is not None
    assert table.stats().hits == 1 and table.stats().keyed_hits == 1


def test_a_removed_leased_object_stops_being_served_by_key_at_once() -> None:
    keyed = FakeKeyedReads()
    table, _ = make(blocks=2, keyed=keyed)
    put(table, ["a"])
    lease = table.get(["a"]).lease_id
    assert table.remove(["a"]) == 1
    assert "a" not in keyed.served  # a new reader by key misses; the leased reader goes on
    assert lease is not None and table.release(lease)
    assert table.stats().bytes_used == 0


def pinned_put(table: ObjectTable, keys: list[str], pin_s: float) -> None:
    res = table.put_start(keys, [BLOCK] * len(keys), pin_s=pin_s)
    assert all(off is not None for off in res.offsets)
    table.put_end(keys, [0] * len(keys))


def test_soft_pinned_objects_are_evicted_only_when_nothing_else_makes_room() -> None:
    table, clock = make(blocks=4)
    pinned_put(table, ["pin-a", "pin-b"], pin_s=60.0)
    put(table, ["c", "d"])
    assert put(table, ["e", "f"]) == [True, True]  # room made from the unpinned ones
    assert table.exists(["pin-a", "pin-b", "c", "d", "e", "f"])[0] == [
        True, True, False, False, True, True]
    clock.now += 30.0
    table.release(table.get(["pin-a"]).lease_id or "")  # a read renews pin-a's pin
    clock.now += 40.0  # pin-b's pin (70 s old) has ended, pin-a's (40 s) lasts
    assert put(table, ["g"]) == [True]
    assert table.exists(["pin-a", "pin-b", "e"])[0] == [True, False, True]
    # e, f, g make room for three; for the fourth the pinned one is all that is left to take.
    assert put(table, ["h", "i", "j", "k"]) == [True] * 4
    assert table.exists(["pin-a", "e", "f", "g"])[0] == [False] * 4


def test_soft_pins_stay_above_the_high_watermark() -> None:
    table = ObjectTable(BLOCK * 4, high_watermark=0.5, clock=FakeClock())
    pinned_put(table, ["soft-a", "soft-b", "soft-c"], pin_s=60.0)
    assert put(table, ["x"]) == [True]  # over the watermark: the unpinned x goes, not the pins
    assert table.exists(["soft-a", "soft-b", "soft-c", "x"])[0] == [True, True, True, False]


def test_hard_pins_are_never_evicted_and_a_put_that_needs_them_is_refused() -> None:
    table, clock = make(blocks=4)
    pinned_put(table, ["hard-1", "hard-2"], pin_s=float("inf"))
    pinned_put(table, ["soft"], pin_s=60.0)
    put(table, ["plain"])
    assert put(table, ["x", "y"]) == [True, True]
    assert table.exists(["hard-1", "hard-2", "soft", "plain"])[0] == [True, True, False, False]
    table.remove(["x", "y"])
    pinned_put(table, ["hard-3", "hard-4"], pin_s=float("inf"))
    clock.now += 86400.0  # a hard pin does not end
    assert put(table, ["z"]) == [False]
    assert table.exists(["hard-1", "hard-2", "hard-3", "hard-4"])[0] == [True] * 4
