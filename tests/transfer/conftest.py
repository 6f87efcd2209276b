"""Fixtures of the transfer-engine tests: a peer process serving a segment of known bytes."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from transfer_helpers import SEED, SEG_BYTES, Peer, start_peer


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """A peer process (one per test module) serving segment "kv" filled with `expected`."""
    p = start_peer()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def expected() -> bytes:
    """The bytes the peer's segment holds."""
    return random.Random(SEED).randbytes(SEG_BYTES)
