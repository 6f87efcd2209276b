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
import torch
from fuzz_helpers import (
    CONTEXT,
    LiveCluster,
    ServerThread,
    bound_socket,
    role_config,
    wait_healthy,
)

from mooncake_server.roles import app_for_role


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama with the default model's tokenizer, saved like any HF model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from mooncake_server.model_assets import resolve_model

    out = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=CONTEXT, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def colocated_url(tiny_model_dir: str) -> Iterator[str]:
    """`--role colocated` over the tiny model, API key set."""
    servers = ServerThread()
    sock, port = bound_socket()
    try:
        servers.serve(app_for_role(role_config("colocated", port, tiny_model_dir)), sock)
        yield f"http://127.0.0.1:{port}"
    finally:
        servers.stop()
        sock.close()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str) -> Iterator[LiveCluster]:
    """The disaggregated path in one process: every role's real app, KV over the TCP engine."""
    servers = ServerThread()
    live = LiveCluster(urls={})
    try:
        conductor_url = ""
        for role in ("conductor", "store", "prefill", "decode"):
            sock, port = bound_socket()
            live.sockets.append(sock)
            extra = {"conductor_url": conductor_url} if role != "conductor" else {}
            servers.serve(app_for_role(role_config(role, port, tiny_model_dir, **extra)), sock)
            live.urls[role] = f"http://127.0.0.1:{port}"
            conductor_url = conductor_url or live.urls["conductor"]
        wait_healthy(live.url)
        store = httpx.get(live.urls["store"] + "/health", timeout=5).json()
        live.store_transfer_address = store["transfer_address"]
        live.store_segment = store["segment"]
        live.store_control_address = store["control_address"]
        yield live
    finally:
        servers.stop()
        for sock in live.sockets:
            sock.close()
