"""glibc malloc keeps a forward thread's freed activations mapped (malloc_tuning.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mooncake_server.malloc_tuning import (HUGE_PAGES_TUNABLE, THP_MODE,
                                          huge_pages_environment)

# A forward thread's pattern: the same large activations allocated and freed pass after pass.
PASSES = """
import resource, sys, threading
if sys.argv[1] == "tuned":
    from mooncake_server.malloc_tuning import keep_freed_memory
    print(keep_freed_memory())
else:
    print(None)
import torch
torch.set_num_threads(1)
a = torch.randn(2048, 3072)
def one():
    y = a * 2.0                      # 25 MB
    z = y[:, :1536] * y[:, 1536:]    # 12.6 MB
    s = torch.nn.functional.silu(z)  # 12.6 MB
    del y, z, s
faults = []
def passes():
    for _ in range(10):  # the heap reaches its working set
        one()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(20):
        one()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=passes)
t.start()
t.join()
print(faults[0])
"""
PAGES_TOUCHED = 20 * (2048 * 3072 + 2 * 2048 * 1536) * 4 // 4096


def fresh_python(script: str, mode: str, env: dict[str, str] | None = None) -> str:
    """`script`'s output in a fresh interpreter whose malloc only `env` tunes."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return subprocess.run([sys.executable, "-c", script, mode], env={**clean, **(env or {})},
                          capture_output=True, text=True, check=True, timeout=120).stdout


def run_passes(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    """What keep_freed_memory answered in a fresh process, and its passes' page faults."""
    out = fresh_python(PASSES, mode, env).split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activations_stay_mapped_from_pass_to_pass() -> None:
    answered, faults = run_passes("tuned")
    assert answered == "True"
    assert faults < PAGES_TOUCHED * 0.05, (faults, PAGES_TOUCHED)
    # What the tuning prevents: the thread's arena gives its heaps back and faults them in again.
    _, untuned = run_passes("plain")
    assert untuned > PAGES_TOUCHED * 0.15, (untuned, PAGES_TOUCHED)


def test_malloc_tuning_from_the_environment_wins() -> None:
    answered, _ = run_passes("tuned", {"MALLOC_ARENA_MAX": "4"})
    assert answered == "False"


# Where a second thread's 64 KiB allocation lands: in the main arena's [heap] or an arena of its own.
ARENA = """
import ctypes, sys, threading
if sys.argv[1] == "tuned":
    from mooncake_server.malloc_tuning import keep_freed_memory
    keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
got = []
def allocate():
    p = libc.malloc(1 << 16)  # below any mmap threshold
    got.append(p)
    libc.free(p)
t = threading.Thread(target=allocate)
t.start()
t.join()
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
        print("main" if lo <= got[0] < hi else "own")
        break
else:
    print("own")
"""


def thread_arena(mode: str, env: dict[str, str] | None = None) -> str:
    """'main' or 'own': the arena a second thread's allocation came from in a fresh process."""
    return fresh_python(ARENA, mode, env).strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_threads_keep_arenas_of_their_own() -> None:
    # One arena for every thread put fbgemm's workers and the forward thread on one lock
    # (int8 one-token steps 13-14 ms -> 19-21 ms): the tuning must not do that.
    assert thread_arena("tuned") == "own"
    assert thread_arena("plain", {"MALLOC_ARENA_MAX": "1"}) == "main"


def test_huge_pages_only_where_nobody_tuned_malloc_and_thp_wants_madvise() -> None:
    madvise = "always [madvise] never\n"
    env = huge_pages_environment({"PATH": "/bin"}, madvise)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}
    assert huge_pages_environment(env, madvise) is None  # set already: no second restart
    assert huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, madvise) is None
    assert huge_pages_environment({"MALLOC_ARENA_MAX": "2"}, madvise) is None
    assert huge_pages_environment({}, "[always] madvise never") is None
    assert huge_pages_environment({}, "always madvise [never]") is None


# A command line calling restart_with_huge_pages, then filling 64 MB from malloc.
RESTART = """
import ctypes, os
from mooncake_server.malloc_tuning import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages()
print(os.environ.get("GLIBC_TUNABLES"), keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(64 << 20)
ctypes.memset(p, 1, 64 << 20)
print(sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
          if line.startswith("AnonHugePages:")) // 1024)
"""


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
                    reason="THP is not in madvise mode here")
def test_the_command_line_restarts_itself_onto_huge_pages() -> None:
    tunables, tuned, huge_mb = fresh_python(RESTART, "").split()
    # the restart kept the mallopt tuning on (the tunable is ours, not the user's)
    assert (tunables, tuned) == (HUGE_PAGES_TUNABLE, "True")
    assert int(huge_mb) >= 32, huge_mb
    # what the restart gives: without it the same 64 MB lies on 4 KiB pages
    tunables, _, huge_mb = fresh_python(RESTART, "", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
                                        ).split()
    assert tunables == "glibc.malloc.hugetlb=0" and int(huge_mb) < 32
