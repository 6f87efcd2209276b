"""Engine processes on one machine take turns on its cores: one forward pass at a time, all
cores each, a process that just had a turn letting a waiting one go first."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from mooncake_server.engine.core_budget import CoreBudget, core_budget_for


class _Neighbour:
    """A second engine process on the board, driven line by line over stdin."""

    def __init__(self, path: str) -> None:
        code = ("import sys; from mooncake_server.engine.core_budget import CoreBudget; "
                f"b = CoreBudget({path!r}, 2); print('ok', flush=True)\n"
                "for line in sys.stdin:\n"
                "    cmd = line.strip()\n"
                "    if cmd == 'enter': b.enter_step(); print('in', flush=True)\n"
                "    elif cmd == 'exit': b.exit_step(); print('out', flush=True)\n"
                "    elif cmd == 'active': b.set_active(True); print('ok', flush=True)\n")
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
    while not me._others(2):  # its slot says it waits (set before it blocks)
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


def test_pinned_threads_ignore_the_board(tmp_path) -> None:
    fixed = core_budget_for(str(tmp_path / "cores"), 2, torch_threads=1)
    assert fixed.enter_step() == 1 and fixed.others_active() == 0
    fixed.exit_step()
    assert not os.path.exists(tmp_path / "cores")
