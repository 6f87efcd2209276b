"""Real clusters on 127.0.0.1 with the real default model, and an HF reference to compare with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mooncake_server.model_assets import resolve_model
from mooncake_testkit.launcher import Cluster, start_cluster


@pytest.fixture(scope="session")
def model_path() -> str:
    """The converted default model."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_path: str):  # noqa: ANN201
    """The default model's tokenizer."""
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path: str) -> torch.nn.Module:
    """Single-process HuggingFace reference model."""
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, tokenizer):  # noqa: ANN001, ANN201
    """f(prompt_ids, max_new_tokens) -> HF generate's greedy token ids (EOS included)."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=tokenizer.eos_token_id)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="module")
def all_cluster() -> Iterator[Cluster]:
    """`mooncake-server --role all`: conductor, store, prefill, decode as separate processes."""
    cluster = start_cluster("all")
    yield cluster
    cluster.stop()
