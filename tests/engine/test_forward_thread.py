"""An engine process keeps one OpenMP pool: the forward thread's team; every other thread that
touches torch (the event loop, threads started later) runs its ops alone.

A second pool made libgomp stop spinning between parallel regions and slowed every pass 1.7-2.5x
(forward_thread.py); team sizes per thread are what decide it, so they are what is checked, in
a fresh interpreter (torch's thread settings are process-wide state).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROCESS = """
import json, threading, torch
from mooncake_server.engine.core_budget import {budget}
from mooncake_server.engine.forward_thread import forward_thread, no_team_on_this_thread

ex = forward_thread("test")
budget = {make}
def load():  # the model's load and kernel timing: parallel work, turns held
    torch.ones(1 << 20).sum()
    budget.enter_step(); budget.exit_step()
ex.submit(load).result()
no_team_on_this_thread()  # the event loop, once the runner is built
def step():
    threads = budget.enter_step()
    torch.ones(1 << 20).sum()
    budget.exit_step()
    return threads, torch.get_num_threads()
passes = [ex.submit(step).result() for _ in range(3)]
later = []
t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
t.start(); t.join()
print(json.dumps({{"passes": passes, "event_loop": torch.get_num_threads(), "later": later[0]}}))
"""


@pytest.mark.parametrize("budget,make", [
    ("FixedThreads", "FixedThreads(2)"),
    ("CoreBudget", "CoreBudget({board!r}, 2)"),
])
def test_only_the_forward_thread_has_a_team(tmp_path, budget: str, make: str) -> None:
    code = _PROCESS.format(budget=budget, make=make.format(board=str(tmp_path / "board")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["passes"] == [[2, 2]] * 3  # every pass runs with the whole budget
    assert seen["event_loop"] == 1
    assert seen["later"] == 1  # a thread started after the engine would not make a second pool
