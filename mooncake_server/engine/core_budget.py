"""Cores as a budget the engine processes of one machine share, lent to whichever has work.

`--role all` runs a prefill and a decode process on the same cores. With torch's default thread
team in each, both run two OpenMP teams on two cores whenever both have work, and the teams'
barriers thrash (a 16-stream decode fell to half its speed); a static split instead halves a
lone prefill. So each engine process announces, in a small shared file, whether it has work; before
every forward pass it sizes its thread team to an equal share of the budget among the processes
that have work: all of it alone, half of it beside one other.

The board is a file of fixed slots (pid, active) mapped by every process; a slot is claimed under
an flock, and a slot whose pid is gone (a SIGKILLed process) counts as idle.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SLOTS = 64
_SLOT = struct.Struct("<qq")  # pid, active
_LIVENESS_EVERY_S = 1.0


def machine_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_for(budget: int, others_active: int) -> int:
    """An equal share of `budget` cores among this process and the others that have work."""
    return max(1, budget // (1 + others_active))


class CoreBudget:
    """This process's slot on the shared board, and the thread team it may run now."""

    def __init__(self, path: str | Path, budget: int) -> None:
        self.budget = max(1, budget)
        self.pid = os.getpid()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            if os.fstat(self._fd).st_size < _SLOTS * _SLOT.size:
                os.ftruncate(self._fd, _SLOTS * _SLOT.size)
            self._map = mmap.mmap(self._fd, _SLOTS * _SLOT.size)
            self._slot = self._claim()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._alive: dict[int, bool] = {}
        self._checked_at = 0.0
        self._threads = 0
        log.info("core budget %d shared through %s (slot %d)", self.budget, path, self._slot)

    def _claim(self) -> int:
        for i in range(_SLOTS):
            pid, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == 0 or pid == self.pid or not _pid_alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, 0)
                return i
        raise RuntimeError(f"core budget board full ({_SLOTS} engine processes)")

    def set_active(self, active: bool) -> None:
        """Say whether this process has work (queued or running); others shrink their teams."""
        _SLOT.pack_into(self._map, self._slot * _SLOT.size, self.pid, int(active))

    def others_active(self) -> int:
        """Engine processes other than this one that have work now."""
        now = time.monotonic()
        if now - self._checked_at > _LIVENESS_EVERY_S:
            self._alive.clear()
            self._checked_at = now
        n = 0
        for i in range(_SLOTS):
            if i == self._slot:
                continue
            pid, active = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and active:
                alive = self._alive.get(pid)
                if alive is None:
                    alive = self._alive[pid] = _pid_alive(pid)
                n += alive
        return n

    def enter_step(self) -> int:
        """Size this thread's torch team for the next forward pass; returns the thread count.

        Must run on the thread that runs the forward: OpenMP's team size is per calling thread.
        """
        threads = threads_for(self.budget, self.others_active())
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads
        return threads

    def close(self) -> None:
        """Free the slot."""
        try:
            _SLOT.pack_into(self._map, self._slot * _SLOT.size, 0, 0)
            self._map.close()
        finally:
            os.close(self._fd)


class FixedThreads:
    """`--torch-threads N`, or a process alone on its cores: the same team every step."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads or machine_cores()

    def set_active(self, active: bool) -> None:
        """Nothing to announce."""

    def others_active(self) -> int:
        """No board: no other engine is known."""
        return 0

    def enter_step(self) -> int:
        """Set the fixed team on the forward thread (once per thread is enough, but cheap)."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads

    def close(self) -> None:
        """Nothing held."""


def no_team_on_this_thread() -> None:
    """Run torch ops of the calling thread (the event loop's sampling) on that thread alone.

    OpenMP keeps one worker pool per thread that starts parallel work; a second pool, woken by
    each token's argmax on the event loop, spun beside the forward thread's pool and slowed the
    forward passes. The forward thread sets its own team in `enter_step`.
    """
    torch.set_num_threads(1)


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
