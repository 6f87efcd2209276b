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
"""

from __future__ import annotations

import ctypes
import os

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before it is returned
TOP_PAD = 64 << 20  # glibc's per-thread heap size on 64-bit: no heap is ever deleted
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling: larger requests are mmapped whatever is set


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above, before any thread starts; False where it is not glibc or the
    user tuned malloc through the environment (MALLOC_* or GLIBC_TUNABLES: theirs wins)."""
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this interpreter runs on
    except (OSError, AttributeError):  # no mallopt to call: not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(param, value) == 1 for param, value in (
        (M_TOP_PAD, TOP_PAD), (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
