"""The KVCache-centric scheduler: cost model, estimators, Algorithm 1 and its wiring.

`build_scheduler` turns the conductor's config into a `KVCacheScheduler` (policy, SLOs, the
profiled cost model, a prefix oracle); the request path (`request_path.py`) asks it once per request.
"""

from __future__ import annotations

import logging
from typing import Any

from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.loading import kv_bytes_per_token, load_perf_model
from mooncake_server.cost_model.perf_model import PerfModel
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

def build_scheduler(config: ServerConfig, registry: InstanceRegistry,
                    index: PrefixIndex | None = None, hf_config: Any = None,
                    oracle: PrefixOracle | None = None,
                    local: LocalCacheIndex | None = None) -> KVCacheScheduler:
    """The conductor's scheduler: --policy, --ttft-slo / --tbt-slo, --profile, the store index,
    and (`local`) the prefill instances' reports of their own prefix caches."""
    if oracle is None:
        oracle = (IndexPrefixOracle(index, registry, local) if index is not None
                  else NoPrefixOracle())
    model = load_perf_model(config.profile_path, config.block_tokens, config.dtype, hf_config)
    return KVCacheScheduler(registry, model, policy=config.policy,
                            block_tokens=config.block_tokens, oracle=oracle,
                            ttft_slo_s=config.ttft_slo_s, tbt_slo_s=config.tbt_slo_s)
