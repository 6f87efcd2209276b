"""glibc malloc keeps a forward thread's freed activations mapped (malloc_tuning.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
