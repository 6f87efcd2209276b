"""A prefill job inside the worker, from queued to answered."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncake_server.engine.sequence import Sequence
from mooncake_server.roles.prefill.kv_stream import LayerStream
from mooncake_server.wire.jobs import PrefillFirst, PrefillJob, PrefillResult


@dataclass
class PrefillTask:
    """A prefill job and what the worker keeps of it."""

    job: PrefillJob
    done: asyncio.Future[PrefillResult]
    seq: Sequence | None = None
    hit: int = 0  # blocks found in the local cache
    reused: int = 0  # blocks not computed (local hits + store reads)
    keys: list[str] = field(default_factory=list)  # store keys of the blocks this job writes
    write: list[int] = field(default_factory=list)  # their indices in seq.block_ids
    tail_key: str | None = None
    stream: LayerStream | None = None
    started: float = 0.0
    queued_at: float = field(default_factory=time.perf_counter)
    queued_wall: float = field(default_factory=time.time)
    passes: int = 0  # forward passes that computed some of its prompt
    compute_s: float = 0.0  # their compute time
    wait_s: float = 0.0  # their waits for the cores (a decode's steps beside them)
    # Told the first tokens the moment the prompt is computed, before the store writes.
    on_first: Callable[[PrefillFirst], None] | None = None

    def gone(self) -> bool:
        """Its caller went away while it waited."""
        return self.done.done()

    @property
    def answer_by(self) -> float | None:
        """The perf_counter() time its first token is due (None: no deadline)."""
        return self._after_queued(self.job.answer_within_s)

    @property
    def expect_by(self) -> float | None:
        """The perf_counter() time the conductor estimated its first token by (None: none)."""
        return self._after_queued(self.job.expect_within_s)

    def _after_queued(self, within_s: float | None) -> float | None:
        return None if within_s is None else self.queued_at + within_s
