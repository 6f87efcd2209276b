"""Tiny random Llama models on a 4-bit grid (tiny_model_pair is in tests/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from mooncake_testkit.quality import q4_1


@pytest.fixture(scope="session")
def tiny_q4_model_pair(tiny_model_pair) -> tuple[torch.nn.Module, torch.nn.Module]:
    """tiny_model_pair with every linear's weights on a Q4_1 grid (as the bundled GGUF's are)."""
    pair = tuple(copy.deepcopy(m) for m in tiny_model_pair)
    for model in pair:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(q4_1(module.weight))
    return pair
