"""Cores as a budget the engine processes of one machine share: they take turns on all of them.

`--role all` runs a prefill and a decode process on the same cores. Running both at once made
both crawl: on the 2-core machine here a 15-prompt, 1920-token bf16 prefill took 0.51 s alone
and 2.1-2.8 s beside a one-token decode loop with the team split 2 + 1 threads; in
`scripts/bench_serving.py` 16 concurrent streams waited 6.3 s (p50) for a first token, 0.9 s
once the processes took turns. So a forward pass holds the machine: each engine process takes
the turn before a pass, runs it with the whole budget's thread team, and hands the turn on after
it; a process that just had a turn lets a waiting one go first, so a prefill and a decode
alternate pass by pass. The prefill keeps its passes short (--decode-chunk tokens) while a
decode has work, which bounds the decode's token gap to about two passes.

The board is a file of fixed slots (pid, active or loading, waiting, handed-in sequences
started, last pass's compute time) mapped by every process; the turn is an flock on it (the
kernel drops it with a SIGKILLed holder), and a slot whose pid is gone counts as idle. A decode
counts there the sequences prefilled elsewhere that it starts, so the prefill beside it can hold
its next pass for them (roles/prefill/handoff_hold.py), and every process posts its last pass's
time, which sizes the passes of a prefill beside a decode (cost_model/passes.py). A process
loading its model says so: that work takes no turn, so the engines beside it time their
start-up passes only once it is done (instance/engine_role.py, `after_neighbours_load`).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SLOTS = 64
# pid, active, waiting for the turn, handed-in sequences started, last pass's compute (us)
_SLOT = struct.Struct("<qqqqq")
_LAST = struct.Struct("<q")  # after the slots: pid of the last turn's holder
_BOARD_BYTES = _SLOTS * _SLOT.size + _LAST.size
# `active`: 1 while a process has work; 2 while it loads its model, outside any turn.
_WORKING, _LOADING = 1, 2
_YIELD_S = 0.0005  # how long a process that just had the turn steps aside for a waiting one
_LIVENESS_EVERY_S = 1.0


def machine_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CoreBudget:
    """This process's slot on the shared board, and its turns on the cores."""

    def __init__(self, path: str | Path, budget: int) -> None:
        self.budget = max(1, budget)
        self.pid = os.getpid()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            if os.fstat(self._fd).st_size < _BOARD_BYTES:
                os.ftruncate(self._fd, _BOARD_BYTES)
            self._map = mmap.mmap(self._fd, _BOARD_BYTES)
            self._slot = self._claim()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._alive: dict[int, bool] = {}
        self._checked_at = 0.0
        self._active = 0
        self._waiting = 0
        self._handed_in = 0
        self._step_us = 0
        self._slot_lock = threading.Lock()
        log.info("core budget %d shared through %s (slot %d)", self.budget, path, self._slot)

    def _claim(self) -> int:
        for i in range(_SLOTS):
            pid = _SLOT.unpack_from(self._map, i * _SLOT.size)[0]
            if pid == 0 or pid == self.pid or not _pid_alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, 0, 0, 0, 0)
                return i
        raise RuntimeError(f"core budget board full ({_SLOTS} engine processes)")

    def set_active(self, active: bool) -> None:
        """Say whether this process has work (queued or running); a prefill shortens its passes."""
        self._active = _WORKING if active else 0
        self._write_slot()

    def set_loading(self, loading: bool) -> None:
        """Say whether this process is loading its model, which takes no turn on the cores."""
        self._active = _LOADING if loading else 0
        self._write_slot()

    def others_loading(self) -> int:
        """Engine processes other than this one loading their model now."""
        return self._others_in(_LOADING)

    def _others_in(self, state: int) -> int:
        """Live engine processes other than this one whose `active` field is `state`."""
        return sum(1 for slot in self._other_slots() if slot[1] == state)

    def _write_slot(self) -> None:
        # NOTE: the event loop and the forward thread both write the slot; each write reads the
        # fields under the lock, so the last one written carries every thread's last change.
        with self._slot_lock:
            _SLOT.pack_into(self._map, self._slot * _SLOT.size, self.pid, self._active,
                            self._waiting, self._handed_in, self._step_us)

    def _others(self, field: int) -> int:
        """Live engine processes other than this one whose slot has `field` (1 active, 2 waiting)."""
        return sum(1 for slot in self._other_slots() if slot[field])

    def _other_slots(self) -> Iterator[tuple[int, ...]]:
        """The slots of live engine processes other than this one (liveness re-read each second)."""
        now = time.monotonic()
        if now - self._checked_at > _LIVENESS_EVERY_S:
            self._alive.clear()
            self._checked_at = now
        for i in range(_SLOTS):
            if i == self._slot:
                continue
            slot = _SLOT.unpack_from(self._map, i * _SLOT.size)
            pid = slot[0]
            if not pid:
                continue
            alive = self._alive.get(pid)
            if alive is None:
                alive = self._alive[pid] = _pid_alive(pid)
            if alive:
                yield slot

    def others_active(self) -> int:
        """Engine processes other than this one that have work now."""
        return self._others_in(_WORKING)

    def others_present(self) -> int:
        """Engine processes other than this one on these cores, busy or not."""
        return self._others(0)

    def note_handed_in(self, sequences: int) -> None:
        """Say that `sequences` handed to this process (prefilled elsewhere) join a step now."""
        if sequences:
            self._handed_in += sequences
            self._write_slot()

    def others_handed_in(self) -> int:
        """Handed-in sequences that live engine processes other than this one have started."""
        return sum(slot[3] for slot in self._other_slots())

    def note_step(self, compute_s: float) -> None:
        """Post this process's last pass time (a prefill beside it sizes its passes by it)."""
        self._step_us = int(compute_s * 1e6)
        self._write_slot()

    def others_step_s(self) -> float:
        """The longest last pass of the other live engine processes that have work (0.0: none)."""
        return max((slot[4] for slot in self._other_slots() if slot[1] == _WORKING), default=0) / 1e6

    def others_waiting(self) -> int:
        """Engine processes other than this one waiting for the turn now."""
        return self._others(2)

    def enter_step(self) -> int:
        """Wait for this process's turn on the cores, then size its team; returns the threads.

        Must run on the thread that runs the forward (OpenMP's team size is per calling thread),
        and be followed by `exit_step` once the pass is done.
        """
        self._waiting = 1
        self._write_slot()
        while True:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            (last,) = _LAST.unpack_from(self._map, _SLOTS * _SLOT.size)
            if last != self.pid or not self.others_waiting():
                break
            # This process had the last turn and another one waits: it goes first.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            time.sleep(_YIELD_S)
        _LAST.pack_into(self._map, _SLOTS * _SLOT.size, self.pid)
        self._waiting = 0
        self._write_slot()
        # NOTE: the calling thread's own team size: setting it also sets the size new threads
        # take, which the event loop has set to 1 (forward_thread.py).
        if torch.get_num_threads() != self.budget:
            torch.set_num_threads(self.budget)
        return self.budget

    def exit_step(self) -> None:
        """Hand the turn on."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Free the slot."""
        try:
            _SLOT.pack_into(self._map, self._slot * _SLOT.size, 0, 0, 0, 0, 0)
            self._map.close()
        finally:
            os.close(self._fd)


class FixedThreads:
    """`--torch-threads N`, or a process alone on its cores: the same team every step."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads or machine_cores()

    def set_active(self, active: bool) -> None:
        """Nothing to announce."""

    def set_loading(self, loading: bool) -> None:
        """Nothing to announce."""

    def others_loading(self) -> int:
        """No board: no other engine is known."""
        return 0

    def others_active(self) -> int:
        """No board: no other engine is known."""
        return 0

    def others_present(self) -> int:
        """No board: no other engine is known."""
        return 0

    def note_handed_in(self, sequences: int) -> None:
        """Nobody to tell."""

    def others_handed_in(self) -> int:
        """No board: no other engine is known."""
        return 0

    def note_step(self, compute_s: float) -> None:
        """Nobody to tell."""

    def others_step_s(self) -> float:
        """No board: no other engine is known."""
        return 0.0

    def enter_step(self) -> int:
        """Set the fixed team on the forward thread (once per thread is enough, but cheap)."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads

    def exit_step(self) -> None:
        """No turn to hand on."""

    def close(self) -> None:
        """Nothing held."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def core_budget_for(share_path: str | None, budget: int | None,
                    torch_threads: int | None) -> CoreBudget | FixedThreads:
    """The budget an engine process runs under: fixed threads if pinned, shared if a board is set."""
    if torch_threads or not share_path:
        return FixedThreads(torch_threads)
    return CoreBudget(share_path, budget or machine_cores())
