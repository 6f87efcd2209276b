"""Fixtures shared by every test folder."""

from __future__ import annotations

import copy

import pytest
import torch

# Short enough that any generation over the tiny model stays fast.
TINY_CONTEXT = 128


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
                      max_position_embeddings=TINY_CONTEXT, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference HF model with sdpa, same weights with our paged attention)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mooncake_server.engine.attention import register_paged_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=1, pad_token_id=0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=register_paged_attention())
    paged.load_state_dict(ref.state_dict())
    return ref, paged.eval()
