"""Shared memory (an engine's KV pool, the store's DRAM pool) is resident from the start.

Left to fault in page by page, a prefill's first use of each pool page cost a page fault inside
its forward pass: 25-45k a 1024-token prompt (80-180 ms of system time) until every page had
been used once, so `--role all` answered a first token 1.2-1.4x slower than colocated.
"""

from __future__ import annotations

import mmap
import resource

from transfer_helpers import SECRET

from mooncake_server.transfer import TransferEngine


def test_a_fresh_shared_buffer_is_written_without_page_faults() -> None:
    engine = TransferEngine(secret=SECRET, timeout_s=5.0)
    try:
        buf = engine.alloc_shared("pool", 32 << 20)
        page = mmap.PAGESIZE
        pages = len(buf) // page
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buf[::page] = b"\x01" * pages  # one byte on every page, as KV writes would
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faults < pages // 100, f"{faults} page faults writing {pages} fresh pages"
        assert buf[page * 7] == 1 and buf[page * 7 + 1] == 0
    finally:
        engine.close()
