"""The KVCache-centric scheduler: cost model, estimators, Algorithm 1 and its wiring.

`build_scheduler` turns the conductor's config into a `KVCacheScheduler` (policy, SLOs, the
profiled cost model, a prefix oracle); the request path (`request_path.py`) asks it once per request.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.engine.cpu import resolve_dtype_name
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler.local_index import LocalCacheIndex
from mooncake_server.roles.conductor.scheduler.oracle import (
    IndexPrefixOracle,
    NoPrefixOracle,
    PrefixIndex,
    PrefixOracle,
)
from mooncake_server.roles.conductor.scheduler.policy import KVCacheScheduler, Policy, SLORejected

log = logging.getLogger(__name__)

__all__ = ["KVCacheScheduler", "LocalCacheIndex", "PerfModel", "Policy", "SLORejected",
           "build_scheduler", "kv_bytes_per_token", "load_perf_model"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(hf_config: Any, dtype: str) -> int | None:
    """KV bytes one token occupies (all layers, K and V), from a HF model config; None if unknown."""
    try:
        heads = int(hf_config.num_attention_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        layers = int(hf_config.num_hidden_layers)
    except (AttributeError, TypeError, ValueError):
        return None
    # NOTE: 'auto' as the engines on this machine decide it
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES.get(resolve_dtype_name(dtype), 4)


def load_perf_model(config: ServerConfig, hf_config: Any = None) -> PerfModel:
    """The --profile file, else built-in coefficients sized to the served model's KV."""
    if config.profile_path:
        model = PerfModel.load(config.profile_path)
        log.info("cost model from %s (profiled %s)", config.profile_path, model.model)
        return model
    per_token = kv_bytes_per_token(hf_config, config.dtype) if hf_config is not None else None
    model = PerfModel(block_tokens=config.block_tokens)
    log.info("no --profile: built-in cost model (run `mooncake-server profile` for this machine)")
    return dataclasses.replace(model, kv_bytes_per_token=per_token) if per_token else model


def build_scheduler(config: ServerConfig, registry: InstanceRegistry,
                    index: PrefixIndex | None = None, hf_config: Any = None,
                    oracle: PrefixOracle | None = None,
                    local: LocalCacheIndex | None = None) -> KVCacheScheduler:
    """The conductor's scheduler: --policy, --ttft-slo / --tbt-slo, --profile, the store index,
    and (`local`) the prefill instances' reports of their own prefix caches."""
    if oracle is None:
        oracle = (IndexPrefixOracle(index, registry, local) if index is not None
                  else NoPrefixOracle())
    return KVCacheScheduler(registry, load_perf_model(config, hf_config), policy=config.policy,
                            block_tokens=config.block_tokens, oracle=oracle,
                            ttft_slo_s=config.ttft_slo_s, tbt_slo_s=config.tbt_slo_s)
