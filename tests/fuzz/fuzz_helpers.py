"""Helpers of the fuzz tests: the tiny-model role configs and the live cluster they form.

A uniquely named module (not conftest) so tests import it without clashing with other folders'
conftest modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from mooncake_server.config import ServerConfig

API_KEY = "fuzz-api-key"
SECRET = "fuzz-cluster-secret"
MAX_TOKENS = 16  # --max-tokens-limit of the servers under test


def role_config(role: str, port: int, model: str, **extra: Any) -> ServerConfig:
    return ServerConfig(role=role, port=port, model=model, served_model_name="tiny",
                        cluster_secret=SECRET, api_key=API_KEY, dtype="float32", max_tokens_limit=MAX_TOKENS,
                        kv_memory_bytes=8 << 20, store_memory_bytes=64 << 20, max_batch_size=8,
                        prefill_chunk_tokens=64, heartbeat_interval_s=0.2, transport="tcp",
                        transfer_timeout_s=5.0, **extra)


@dataclass
class LiveCluster:
    """A conductor, a store, a prefill and a decode instance, each a real role app."""

    urls: dict[str, str]
    store_transfer_address: str = ""
    store_segment: str = ""
    store_control_address: str = ""

    @property
    def url(self) -> str:
        """The public API (the conductor)."""
        return self.urls["conductor"]


def chat_ok(url: str, content: str = "Hello there", max_tokens: int = 4) -> dict[str, Any]:
    """One valid chat completion; asserts it succeeded."""
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": [{"role": "user", "content": content}],
                         "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["usage"]["completion_tokens"] >= 1
    return body
