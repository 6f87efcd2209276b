"""TTFT and TBT estimates: queue + transfer + prefill, and fetch only when it beats recompute."""

from __future__ import annotations

import dataclasses

import pytest
from sched_helpers import MODEL

from mooncake_server.roles.conductor.scheduler.estimators import (
    estimate_prefill,
    estimate_tbt,
    reusable_blocks,
)
from mooncake_server.roles.conductor.scheduler.load import DecodeLoad


def test_ttft_adds_queue_transfer_and_uncached_prefill() -> None:
    est = estimate_prefill(MODEL, "p1", 1000, local_tokens=0, remote_tokens=800, queue_s=0.5)
    # 800 tokens × 1000 B / 1e8 B/s = 8 ms transfer; 200 tokens computed = 0.2 + 0.01 s.
    assert est.fetched_tokens == 800 and est.reused_tokens == 800
    assert est.transfer_s == pytest.approx(0.008)
    assert est.compute_s == pytest.approx(0.21)
    assert est.ttft_s == pytest.approx(0.5 + 0.008 + 0.21)


def test_local_prefix_needs_no_transfer() -> None:
    est = estimate_prefill(MODEL, "p1", 1000, local_tokens=800, remote_tokens=800, queue_s=0.0)
    assert est.transfer_s == 0.0 and est.fetched_tokens == 0 and est.reused_tokens == 800
    assert est.ttft_s == pytest.approx(0.21)


def test_recompute_when_the_link_is_slower_than_the_model() -> None:
    slow_link = dataclasses.replace(MODEL, transfer_bytes_per_s=1e5)  # 10 ms per token
    est = estimate_prefill(slow_link, "p1", 1000, local_tokens=0, remote_tokens=800, queue_s=0.0)
    assert est.fetched_tokens == 0 and est.reused_tokens == 0
    assert est.ttft_s == pytest.approx(MODEL.prefill_s(1000))


def test_calibration_scales_compute_not_transfer() -> None:
    base = estimate_prefill(MODEL, "p1", 1000, local_tokens=0, remote_tokens=800, queue_s=0.0)
    slow = estimate_prefill(MODEL, "p1", 1000, local_tokens=0, remote_tokens=800, queue_s=0.0,
                            calibration=2.0)
    assert slow.compute_s == pytest.approx(2 * base.compute_s)
    assert slow.transfer_s == base.transfer_s


def test_tbt_counts_the_new_request_in_the_batch() -> None:
    assert estimate_tbt(MODEL, DecodeLoad(0, 0), 100) == pytest.approx(0.025)
    assert estimate_tbt(MODEL, DecodeLoad(3, 900), 100) == pytest.approx(0.02 + 4 * 0.005)


def test_at_least_one_prompt_token_is_computed() -> None:
    assert reusable_blocks(32, 16) == 1
    assert reusable_blocks(33, 16) == 2
    assert reusable_blocks(1, 16) == 0
