"""The Python heap of a long-running role: what it loaded at start-up leaves the collector's view.

A role loads hundreds of thousands of long-lived objects (modules, model config, tokenizer,
pydantic schemas) before it serves. Python's full collections would walk all of them again and
again, each time stalling whatever request is in flight for milliseconds (a 1 MiB store read
that takes 0.3 ms went to ~2 ms at the 99th percentile). Freezing them once they are loaded
keeps collections to the objects requests create.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now to the collector's permanent generation."""
    gc.collect()
    gc.freeze()
