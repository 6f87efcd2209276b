"""Tiny random Llama models so engine tests run in seconds without the real weights."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from mooncake_server.engine.attention import register_paged_attention
from mooncake_testkit.quality import q4_1


@pytest.fixture(scope="session")
def tiny_model_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference HF model with sdpa, same weights with our paged attention)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=1, pad_token_id=0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=register_paged_attention())
    paged.load_state_dict(ref.state_dict())
    return ref, paged.eval()


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
