"""Engine processes on one machine share its cores: all to one alone, equal shares when busy."""

from __future__ import annotations

import os
import subprocess
import sys

from mooncake_server.engine.core_budget import CoreBudget, core_budget_for, threads_for


def test_share_is_equal_and_never_zero() -> None:
    assert threads_for(2, 0) == 2
    assert threads_for(2, 1) == 1
    assert threads_for(8, 3) == 2
    assert threads_for(1, 5) == 1


def _other_process_board(path: str, active: int) -> subprocess.Popen[str]:
    """A second engine process on the board, announcing `active`, that waits on stdin."""
    code = ("import sys; from mooncake_server.engine.core_budget import CoreBudget; "
            f"b = CoreBudget({path!r}, 2); b.set_active({bool(active)}); print('ok', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
    return proc


def test_a_busy_neighbour_halves_the_team_and_an_idle_or_dead_one_does_not(tmp_path) -> None:
    board = str(tmp_path / "cores")
    me = CoreBudget(board, 2)
    assert me.enter_step() == 2  # alone on the board
    busy = _other_process_board(board, 1)
    idle = _other_process_board(board, 0)
    try:
        assert me.others_active() == 1
        assert me.enter_step() == 1
    finally:
        busy.kill()  # SIGKILL: its slot still says active, but its pid is gone
        busy.wait()
        idle.kill()
        idle.wait()
    me._checked_at = 0.0  # liveness is re-read at most once a second; the test skips the wait
    assert me.enter_step() == 2
    me.close()


def test_pinned_threads_ignore_the_board(tmp_path) -> None:
    fixed = core_budget_for(str(tmp_path / "cores"), 2, torch_threads=1)
    assert fixed.enter_step() == 1 and fixed.others_active() == 0
    assert not os.path.exists(tmp_path / "cores")
