"""Engine processes on one machine take turns on its cores: one forward pass at a time, all
cores each, a process that just had a turn letting a waiting one go first."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from mooncake_server.engine.core_budget import CoreBudget, core_budget_for
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.engine.model_runner import ModelRunner
from mooncake_server.engine.sequence import Sequence
from mooncake_server.instance.engine_role import after_neighbours_load
from mooncake_server.wire.jobs import SamplingParams


class _Neighbour:
    """A second engine process on the board, driven line by line over stdin."""

    def __init__(self, path: str) -> None:
        code = ("import sys; from mooncake_server.engine.core_budget import CoreBudget; "
                f"b = CoreBudget({path!r}, 2); print('ok', flush=True)\n"
                "for line in sys.stdin:\n"
                "    cmd = line.strip()\n"
                "    if cmd == 'enter': b.enter_step(); print('in', flush=True)\n"
                "    elif cmd == 'exit': b.exit_step(); print('out', flush=True)\n"
                "    elif cmd == 'active': b.set_active(True); print('ok', flush=True)\n"
                "    elif cmd == 'waiting': print(b.others_waiting(), flush=True)\n"
                "    elif cmd == 'handed': b.note_handed_in(2); print('ok', flush=True)\n"
                "    elif cmd == 'step': b.note_step(0.075); print('ok', flush=True)\n"
                "    elif cmd == 'idle': b.set_active(False); print('ok', flush=True)\n"
                "    elif cmd == 'loading': b.set_loading(True); print('ok', flush=True)\n"
                "    elif cmd == 'loaded': b.set_loading(False); print('ok', flush=True)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.read() == "ok"

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    async def ask(self, cmd: str) -> str:
        """Send `cmd` and read its answer off the event loop (an engine loop runs on it)."""
        self.send(cmd)
        return await asyncio.to_thread(self.read)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: whatever it held, the kernel drops
        self.proc.wait()


def _enter_in_thread(me: CoreBudget) -> threading.Event:
    """me.enter_step() on a thread (the forward thread's view); the event is set once it got in."""
    got = threading.Event()
    threading.Thread(target=lambda: (me.enter_step(), got.set()), daemon=True).start()
    return got


@pytest.fixture
def pair(tmp_path) -> Iterator[tuple[CoreBudget, _Neighbour]]:
    """This process and a neighbour on one fresh board."""
    board = str(tmp_path / "cores")
    me = CoreBudget(board, 2)
    other = _Neighbour(board)
    yield me, other
    other.kill()
    me.close()


def test_a_pass_runs_alone_with_every_core_of_the_budget(pair) -> None:
    me, other = pair
    assert me.enter_step() == 2  # nobody else wants the cores
    me.exit_step()
    other.send("enter")
    assert other.read() == "in"
    got = _enter_in_thread(me)
    assert not got.wait(0.3)  # the neighbour's pass holds the cores
    other.send("exit")
    assert other.read() == "out"
    assert got.wait(30)
    me.exit_step()


def test_a_process_that_just_had_the_turn_lets_a_waiting_one_go_first(pair) -> None:
    me, other = pair
    me.enter_step()
    other.send("enter")  # it waits for my pass
    while not me.others_waiting():  # its slot says it waits (set before it blocks)
        pass
    me.exit_step()
    got = _enter_in_thread(me)  # straight back for another pass
    assert other.read() == "in"  # ... but the neighbour got the turn
    assert not got.is_set()
    other.send("exit")
    assert got.wait(30)
    me.exit_step()


def test_a_killed_neighbour_frees_its_turn_and_its_slot(pair) -> None:
    me, other = pair
    other.send("active")
    assert other.read() == "ok"
    assert me.others_active() == 1
    other.send("enter")
    assert other.read() == "in"
    other.kill()
    got = _enter_in_thread(me)
    assert got.wait(30)  # the kernel released the dead holder's flock
    me.exit_step()
    me._checked_at = 0.0  # liveness is re-read at most once a second; the test skips the wait
    assert me.others_active() == 0


def test_a_decode_tells_the_board_when_handed_sequences_start(pair) -> None:
    me, other = pair
    assert me.others_handed_in() == 0
    other.send("handed")  # its step takes two sequences prefilled elsewhere
    assert other.read() == "ok"
    assert me.others_handed_in() == 2
    me.note_handed_in(3)  # a process's own count is not another's
    assert me.others_handed_in() == 2
    other.kill()
    me._checked_at = 0.0  # liveness is re-read at most once a second; the test skips the wait
    assert me.others_handed_in() == 0


def test_a_busy_neighbours_last_pass_time_is_on_the_board(pair) -> None:
    """A prefill sizes its passes by the step of the decode beside it; an idle decode's old
    step does not count."""
    me, other = pair
    for cmd in ("step", "active"):
        other.send(cmd)
        assert other.read() == "ok"
    me.note_step(0.5)  # a process's own pass is not another's
    assert me.others_step_s() == pytest.approx(0.075)
    other.send("idle")
    assert other.read() == "ok"
    assert me.others_step_s() == 0.0


async def test_start_up_passes_are_timed_once_the_neighbours_have_loaded(pair) -> None:
    """A neighbour loading its model works outside the turns: a decode's quiet step timed then
    read 10.6x its cost and an idle cluster refused every request. Loading is not work (a
    prefill does not cut its passes for it); the timing waits for it to end, and no longer."""
    me, other = pair
    assert await other.ask("loading") == "ok"
    assert me.others_loading() == 1 and me.others_active() == 0
    waiting = asyncio.create_task(after_neighbours_load(me))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    assert await other.ask("loaded") == "ok"
    assert await asyncio.wait_for(waiting, 5.0) >= 0.2
    assert me.others_loading() == 0
    # A neighbour that never ends loading holds the timing up only as long as it is told.
    assert await other.ask("loading") == "ok"
    assert 0.1 <= await after_neighbours_load(me, timeout_s=0.1) < 5.0


def test_pinned_threads_ignore_the_board(tmp_path) -> None:
    fixed = core_budget_for(str(tmp_path / "cores"), 2, torch_threads=1)
    assert fixed.enter_step() == 1 and fixed.others_active() == 0
    fixed.exit_step()
    fixed.note_step(0.1)
    assert fixed.others_step_s() == 0.0
    assert not os.path.exists(tmp_path / "cores")


async def test_a_sequence_arriving_while_a_decode_waits_for_the_cores_joins_its_next_step(
        pair, tiny_model_pair) -> None:
    """A prefill's hand-off lands while the decode beside it waits for the prefill's next pass:
    its second token comes from the step after that pass, not one pass and one step later."""
    me, other = pair
    _, paged = tiny_model_pair
    kv = PagedKVCache(KVLayout.from_model_config(paged.config, 4, torch.float32), num_blocks=64)
    loop = EngineLoop(ModelRunner(paged, kv, cores=me), ThreadPoolExecutor(1),
                      EngineMetrics(CollectorRegistry()), max_batch_size=8,
                      prefill_chunk_tokens=16)
    sampling = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    decoding = Sequence("decoding", [5, 6, 7], 3, sampling, 512)
    loop.start()
    try:
        loop.submit(decoding)
        await asyncio.wait_for(decoding.events.get(), 30)
        assert await other.ask("enter") == "in"  # the prefill's pass holds the cores
        while await other.ask("waiting") != "1":  # and the decode waits for them
            pass
        while not decoding.events.empty():
            decoding.events.get_nowait()
        handed = Sequence("handed", [8, 9, 10, 11], 4, sampling, 512)
        loop.submit(handed)
        assert await other.ask("exit") == "out"
        after = await asyncio.wait_for(decoding.events.get(), 30)
        first = await asyncio.wait_for(handed.events.get(), 30)
        assert (after.batch_size, first.batch_size) == (2, 2)
    finally:
        await loop.stop()
