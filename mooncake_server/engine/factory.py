"""Build a model runner for a role from the config: resolve model, dtype, KV pool, threads."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_server.config import ServerConfig
from mooncake_server.engine.core_budget import CoreBudget, FixedThreads, core_budget_for
from mooncake_server.engine.cpu import cpu_features, resolve_dtype_name, resolve_quantization
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.model_runner import ModelRunner, load_model, resolve_dtype
from mooncake_server.model_assets import resolve_model, served_name

log = logging.getLogger(__name__)

BufferFactory = Callable[[int], memoryview | bytearray]


@dataclass(frozen=True)
class ModelInfo:
    """What the roles need to know about the served model besides its weights."""

    path: str
    name: str
    max_model_len: int


def max_model_len_of(model_config: object, override: int | None) -> int:
    """Context window: --max-model-len or the model's max_position_embeddings."""
    return override or int(getattr(model_config, "max_position_embeddings", 2048))


def build_runner(config: ServerConfig, make_buffer: BufferFactory) -> tuple[ModelRunner, ModelInfo]:
    """Load the model and a KV pool of `config.kv_memory_bytes` from `make_buffer(nbytes)`."""
    cores = core_budget_for(config.cpu_share_path, config.cpu_budget, config.torch_threads)
    cores.set_loading(True)
    try:
        return _load(config, make_buffer, cores)
    finally:
        cores.set_loading(False)


def _load(config: ServerConfig, make_buffer: BufferFactory,
          cores: CoreBudget | FixedThreads) -> tuple[ModelRunner, ModelInfo]:
    """`build_runner`'s work, while the board says this process is loading."""
    path = resolve_model(config.model)
    cpu = cpu_features()
    dtype_name = resolve_dtype_name(config.dtype)
    quantization = resolve_quantization(config.quantization, config.dtype)
    log.info("CPU %s: dtype %s%s, linears %s", cpu.describe(), dtype_name,
             " (auto)" if config.dtype == "auto" else "",
             "by the CPU's flags" if quantization == "auto" else quantization)
    dtype = resolve_dtype(dtype_name)
    model = load_model(path, dtype, quantization, cpu)
    layout = KVLayout.from_model_config(model.config, config.block_tokens, dtype)
    num_blocks = config.kv_memory_bytes // layout.block_bytes
    if num_blocks < 1:
        raise ValueError(f"--kv-memory: {config.kv_memory_bytes} bytes hold no KV block "
                         f"of {layout.block_bytes} bytes")
    kv = PagedKVCache(layout, make_buffer(num_blocks * layout.block_bytes))
    info = ModelInfo(path, served_name(config.model, config.served_model_name),
                     max_model_len_of(model.config, config.max_model_len))
    log.info("model %s dtype=%s kv_blocks=%d block_bytes=%d", info.name, dtype, kv.num_blocks,
             layout.block_bytes)
    return ModelRunner(model, kv, cores), info
