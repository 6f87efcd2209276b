"""glibc malloc kept from handing a forward pass's buffers back to the kernel between passes.

A forward pass allocates and frees the same large activations layer after layer (a 2048-token
chunk: 25 MB for gate/up, 13 MB for each product). On the forward thread glibc serves them
from a per-thread arena made of 64 MB heaps, and deletes a heap outright whenever its top is
free, whatever M_TRIM_THRESHOLD says; the next layer maps it again and faults every page in
(a prefill process took 240-320k page faults per 4096-token prompt, ~1 GB of pages zeroed, its
TTFT 10-30% above colocated's, whose arena happened to keep its heaps). One arena (the main
one, which only trims past the threshold), a trim threshold above any pass's working set and
the largest mmap threshold glibc allows keep those pages mapped: ~0 faults per prompt.
"""

from __future__ import annotations

import ctypes
import os

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before it is returned
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
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
