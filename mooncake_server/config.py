"""One typed configuration for every role, parsed once at the edge (cli.py) and passed down."""

from __future__ import annotations

import dataclasses
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("conductor", "prefill", "decode", "store", "all", "colocated")
TRANSPORTS = ("auto", "shm", "tcp", "rdma")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8")
POLICIES = ("random", "load", "cache-local", "cache-global")
KV_WRITES = ("auto", "layer", "after")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int, flag: str = "size") -> int:
    """Parse '8GiB', '512MiB', '1000000' into bytes; raise ValueError naming the flag."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{flag}: cannot parse size {text!r} (use e.g. 512MiB, 8GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ServerConfig:
    """Everything a role needs; frozen so no code path can change it after start-up."""

    role: str = "all"
    host: str = "127.0.0.1"
    port: int = 8000
    # Where this role can be reached by others; defaults to host.
    advertise_host: str | None = None
    conductor_url: str | None = None
    instance_id: str | None = None

    # Model
    model: str | None = None  # HF path or id; None = bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = bfloat16 where the CPU has bf16 matmul hardware, else float32
    quantization: str = "auto"  # auto | none | int8 (weight-only int8 linears)
    block_tokens: int = 16
    max_model_len: int | None = None  # None = the model's max_position_embeddings

    # Engine (prefill / decode / colocated)
    kv_memory_bytes: int = 1 << 30
    max_batch_size: int = 32
    prefill_chunk_tokens: int = 2048
    # Colocated: prompt tokens a forward pass may carry while sequences are decoding in it, so a
    # token gap stays near one decode step while long prompts arrive.
    decode_chunk_tokens: int = 256
    torch_threads: int | None = None  # None = the shared core budget decides, step by step
    # Cores the engine processes of this machine share (`--role all`); None = all of them.
    cpu_budget: int | None = None
    # The board the engine processes of one machine share the budget on (`--role all` sets it).
    cpu_share_path: str | None = None
    # prefill: stream each layer's KV to the store | write after the forward | auto (see prefill)
    kv_write: str = "auto"

    # Store
    store_memory_bytes: int = 2 << 30
    store_ssd_dir: str | None = None  # None = no SSD tier
    store_ssd_capacity_bytes: int = 64 << 30
    store_demote_after_s: float = 300.0  # idle objects move from DRAM to SSD after this long
    store_replicas: int = 1  # copies of each block across store nodes (conductor's placement)
    store_high_watermark: float = 0.95  # DRAM fraction above which LRU eviction starts
    store_control_port: int = 0  # binary control channel (put/get/exists...); 0 = any free port
    index_control_port: int = 0  # conductor: binary channel for store nodes' index reports

    # Transfer engine
    transfer_port: int = 0
    transport: str = "auto"
    transfer_timeout_s: float = 10.0
    cluster_secret: str = field(default="", repr=False)

    # Public API: who may call it and how big a request may be
    api_key: str = field(default="", repr=False)  # "" = the public API is open
    max_request_bytes: int = 8 << 20  # body size of a /v1 request (413 above)
    max_messages: int = 2048  # chat messages per request (OpenAI's own limit)
    max_prompt_tokens: int | None = None  # None = the context window
    max_tokens_limit: int | None = None  # largest max_tokens a client may ask; None = context
    max_stop_sequences: int = 4  # OpenAI's own limit
    max_stop_chars: int = 256  # characters per stop sequence
    log_prompts: bool = False  # prompts never reach the logs unless asked

    # Scheduling (conductor): Algorithm 1 policy, SLOs for early rejection, the cost model
    policy: str = "cache-global"  # random | load | cache-local | cache-global
    ttft_slo_s: float | None = None  # None = never reject on TTFT
    tbt_slo_s: float | None = None  # None = never reject on TBT
    profile_path: str | None = None  # `mooncake-server profile` output; None = built-in model

    # Control plane
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    # Faults: how long a SIGTERM'd instance may finish its work; how long the conductor waits
    # for a live instance to move a request to when the one serving it died.
    drain_timeout_s: float = 30.0
    failover_wait_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port: must be in 1..65535, got {self.port}")
        for flag, port in (("--transfer-port", self.transfer_port),
                           ("--store-control-port", self.store_control_port),
                           ("--index-control-port", self.index_control_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{flag}: must be in 0..65535 (0 = any free port), got {port}")
        if self.block_tokens < 1 or self.block_tokens > 4096:
            raise ValueError(f"--block-tokens: must be in 1..4096, got {self.block_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization: must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.decode_chunk_tokens < 1:
            raise ValueError("--decode-chunk: must be at least 1")
        for flag, value in (("--torch-threads", self.torch_threads),
                            ("--cpu-budget", self.cpu_budget)):
            if value is not None and value < 1:
                raise ValueError(f"{flag}: must be at least 1, got {value}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport: must be one of {', '.join(TRANSPORTS)}")
        if self.kv_memory_bytes <= 0:
            raise ValueError("--kv-memory: must be positive")
        if self.store_memory_bytes <= 0:
            raise ValueError("--memory: must be positive")
        if self.store_ssd_capacity_bytes <= 0:
            raise ValueError("--ssd-capacity: must be positive")
        if self.store_ssd_dir is not None and not self.store_ssd_dir.strip():
            raise ValueError("--ssd-dir: must not be empty")
        if not self.store_demote_after_s > 0:
            raise ValueError("--demote-after: must be positive (seconds)")
        if not 0.0 < self.store_high_watermark <= 1.0:
            raise ValueError("--high-watermark: must be in (0, 1]")
        if not 1 <= self.store_replicas <= 16:
            raise ValueError(f"--replicas: must be in 1..16, got {self.store_replicas}")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size: must be at least 1")
        if self.kv_write not in KV_WRITES:
            raise ValueError(f"--kv-write: must be one of {', '.join(KV_WRITES)}, got "
                             f"{self.kv_write!r}")
        if self.prefill_chunk_tokens < self.block_tokens:
            raise ValueError("--prefill-chunk: must be at least --block-tokens")
        self._check_request_limits()
        self._check_scheduling()
        for flag, value in (("--drain-timeout", self.drain_timeout_s),
                            ("--failover-wait", self.failover_wait_s)):
            if not value >= 0:
                raise ValueError(f"{flag}: must not be negative (seconds), got {value}")
        if self.role in ("prefill", "decode", "store") and not self.conductor_url:
            raise ValueError(f"--conductor-url: required for --role {self.role}")

    def _check_scheduling(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: must be one of {', '.join(POLICIES)}, got "
                             f"{self.policy!r}")
        for flag, value in (("--ttft-slo", self.ttft_slo_s), ("--tbt-slo", self.tbt_slo_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag}: must be positive (seconds), got {value}")
        if self.profile_path is not None and not self.profile_path.strip():
            raise ValueError("--profile: must not be empty")

    def _check_request_limits(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-size: must be at least 1KiB, got "
                             f"{self.max_request_bytes}")
        if self.max_messages < 1:
            raise ValueError(f"--max-messages: must be at least 1, got {self.max_messages}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens: must be at least 1, got "
                             f"{self.max_prompt_tokens}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"--max-tokens-limit: must be at least 1, got "
                             f"{self.max_tokens_limit}")
        if self.max_stop_sequences < 0:
            raise ValueError(f"--max-stop: must not be negative, got {self.max_stop_sequences}")
        if self.max_stop_chars < 1:
            raise ValueError(f"--max-stop-chars: must be at least 1, got {self.max_stop_chars}")
        if self.api_key != self.api_key.strip() or any(c.isspace() for c in self.api_key):
            raise ValueError("--api-key: must not contain whitespace")

    @property
    def public_host(self) -> str:
        """Host other roles use to reach this one."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def base_url(self) -> str:
        """HTTP base URL of this role as others reach it."""
        return f"http://{self.public_host}:{self.port}"

    @property
    def secret_bytes(self) -> bytes:
        """The cluster secret as bytes (used for transfer-engine handshakes)."""
        return self.cluster_secret.encode()

    def replace(self, **changes: Any) -> ServerConfig:
        """A copy with some fields changed (the original stays untouched)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def new_secret() -> str:
        """A fresh random cluster secret for an all-in-one cluster."""
        return secrets.token_hex(16)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into flag-name -> value (dashes or underscores accepted)."""
    import yaml  # type: ignore[import-untyped]

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
