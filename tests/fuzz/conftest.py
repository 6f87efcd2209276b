"""Real role apps served on 127.0.0.1 for the fuzz tests: a colocated engine and a whole cluster.

Both run a TINY random Llama (real SmolLM2 tokenizer and chat template, 2 layers, 128-token context)
so every request goes through the real engine path in milliseconds. The servers live in one
background thread with its own event loop, so the tests can drive them with blocking clients
(hypothesis, schemathesis). Apps are built with `app_for_role`, exactly as the CLI builds them.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fuzz_helpers import LiveCluster, role_config

from mooncake_testkit.in_process import AppCluster, wait_healthy


@pytest.fixture(scope="module")
def colocated_url(tiny_model_dir: str) -> Iterator[str]:
    """`--role colocated` over the tiny model, API key set."""
    with AppCluster() as apps:
        yield apps.add("colocated", lambda port: role_config("colocated", port, tiny_model_dir))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str) -> Iterator[LiveCluster]:
    """The disaggregated path in one process: every role's real app, KV over the TCP engine."""
    with AppCluster() as apps:
        live = LiveCluster(urls=apps.urls)
        apps.add("conductor", lambda port: role_config("conductor", port, tiny_model_dir))
        for role in ("store", "prefill", "decode"):
            apps.add(role, lambda port: role_config(role, port, tiny_model_dir,
                                                    conductor_url=live.url))
        wait_healthy(live.url)
        store = httpx.get(live.urls["store"] + "/health", timeout=5).json()
        live.store_transfer_address = store["transfer_address"]
        live.store_segment = store["segment"]
        live.store_control_address = store["control_address"]
        yield live
