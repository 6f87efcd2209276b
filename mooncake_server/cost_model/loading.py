"""The cost model a process runs with: the `--profile` file, else built-in coefficients sized to
the served model's KV. The conductor, prefill and decode instances all load it from here."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.engine.cpu import resolve_dtype_name

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(hf_config: Any, dtype: str) -> int | None:
    """KV bytes a token occupies (all layers, K and V) by a HF model config; None if unknown."""
    try:
        heads = int(hf_config.num_attention_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        layers = int(hf_config.num_hidden_layers)
    except (AttributeError, TypeError, ValueError):
        return None
    # NOTE: 'auto' as the engines on this machine decide it
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES.get(resolve_dtype_name(dtype), 4)


def load_perf_model(profile_path: str | None, block_tokens: int, dtype: str,
                    hf_config: Any = None) -> PerfModel:
    """The profile at `profile_path`, else built-in coefficients sized to the served model's KV."""
    if profile_path:
        model = PerfModel.load(profile_path)
        log.info("cost model from %s (profiled %s)", profile_path, model.model)
        return model
    per_token = kv_bytes_per_token(hf_config, dtype) if hf_config is not None else None
    model = PerfModel(block_tokens=block_tokens)
    log.info("no --profile: built-in cost model (run `mooncake-server profile` for this machine)")
    return dataclasses.replace(model, kv_bytes_per_token=per_token) if per_token else model
