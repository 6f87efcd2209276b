"""Inputs the fuzzers found that once broke the real engine path, kept as fixed examples.

A temperature or top_p below float32's range made sampling raise inside the engine loop, which
killed the loop: that request failed and every later one hung. An out-of-range seed was a 500.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fuzz_helpers import API_KEY, chat_ok

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("extra,status", [
    ({"temperature": 1e-300}, 200),
    ({"temperature": 5e-324, "top_p": 5e-324}, 200),
    ({"top_p": 5e-324, "seed": 3}, 200),
    ({"seed": 2**64 - 1}, 200),
    ({"seed": -(2**63)}, 200),
    ({"seed": 2**64}, 400),
    ({"seed": -(2**63) - 1}, 400),
], ids=["tiny-temperature", "denormal-both", "denormal-top-p", "seed-max", "seed-min",
        "seed-over", "seed-under"])
def test_extreme_sampling_values(colocated_url: str, extra: dict[str, Any], status: int) -> None:
    r = httpx.post(colocated_url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": MESSAGES, "max_tokens": 3, **extra})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "seed"
    chat_ok(colocated_url)  # the engine loop is still alive
