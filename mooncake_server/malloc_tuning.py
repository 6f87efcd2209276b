"""glibc malloc kept from handing a forward pass's buffers back to the kernel between passes.

A forward pass allocates and frees the same large activations layer after layer (a 2048-token
chunk: 25 MB for gate/up, 13 MB for each product). On the forward thread glibc serves them
from a per-thread arena made of 64 MB heaps, and deletes a heap outright whenever its top is
free, whatever M_TRIM_THRESHOLD says; the next layer maps it again and faults every page in
(a prefill process took 240-320k page faults per 4096-token prompt, ~1 GB of pages zeroed, its
TTFT 10-30% above colocated's, whose arena happened to keep its heaps).

glibc deletes such a heap only if what would stay mapped exceeds the top pad; a top pad of a
whole heap (64 MB) therefore keeps every heap, and a trim threshold above any pass's working set
keeps the main arena's top too. The largest mmap threshold glibc allows (32 MiB) keeps the
activations in the arenas at all: ~0 faults per prompt. Threads keep their own arenas: with one
arena for all, fbgemm's workers and the forward thread, which allocate inside every int8 linear,
queued on its lock (113-119 voluntary context switches per one-token step against 3; the step
13-14 ms -> 19-21 ms).

And glibc asks the kernel for transparent huge pages on the memory it maps (tunable
`glibc.malloc.hugetlb=1`, where THP is in `madvise` mode). fbgemm's int8 and fp16 linears read
their packed weights across many 4 KiB pages at once; on 2 MB pages a one-token `--dtype auto`
step took 21.4-22.0 ms against 24.0-24.5 ms (three interleaved pairs; float32, on plain GEMVs,
did not change). glibc reads tunables only when a process starts, so the command line restarts
itself once with the tunable in its environment (`restart_with_huge_pages`), which its child
processes inherit.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from pathlib import Path

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before it is returned
TOP_PAD = 64 << 20  # glibc's per-thread heap size on 64-bit: no heap is ever deleted
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling: larger requests are mmapped whatever is set
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"  # madvise(MADV_HUGEPAGE) on what malloc maps
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above, before any thread starts; False where it is not glibc or the
    user tuned malloc through the environment (MALLOC_* or GLIBC_TUNABLES: theirs wins)."""
    if user_tuned(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this interpreter runs on
    except (OSError, AttributeError):  # no mallopt to call: not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(param, value) == 1 for param, value in (
        (M_TOP_PAD, TOP_PAD), (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def user_tuned(environ: Mapping[str, str]) -> bool:
    """The environment tunes malloc itself (MALLOC_*, or GLIBC_TUNABLES other than ours)."""
    tunables = environ.get("GLIBC_TUNABLES")
    return ((tunables is not None and tunables != HUGE_PAGES_TUNABLE)
            or any(k.startswith("MALLOC_") for k in environ))


def huge_pages_environment(environ: Mapping[str, str], thp_mode: str) -> dict[str, str] | None:
    """`environ` with the huge-page tunable, or None: set already, the user tunes malloc, or
    the kernel's THP mode (`thp_mode`, as its sysfs file reads) is not `madvise` (`always`
    gives huge pages without it, `never` not at all)."""
    if "GLIBC_TUNABLES" in environ or user_tuned(environ) or "[madvise]" not in thp_mode:
        return None
    return {**environ, "GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}


def restart_with_huge_pages() -> None:
    """Re-exec this command line with the huge-page tunable set; returns where none is needed.

    Call it first thing in a command-line entry point, before any thread or heavy import.
    """
    try:
        mode = THP_MODE.read_text()
    except OSError:  # no THP on this kernel (or not Linux)
        return
    env = huge_pages_environment(os.environ, mode)
    if env is not None:
        os.execve(sys.executable, sys.orig_argv, env)
