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
    dtype: str = "auto"
    block_tokens: int = 16
    max_model_len: int | None = None  # None = the model's max_position_embeddings

    # Engine (prefill / decode / colocated)
    kv_memory_bytes: int = 1 << 30
    max_batch_size: int = 32
    prefill_chunk_tokens: int = 2048
    torch_threads: int | None = None

    # Store
    store_memory_bytes: int = 2 << 30

    # Transfer engine
    transfer_port: int = 0
    transport: str = "auto"
    transfer_timeout_s: float = 10.0
    cluster_secret: str = field(default="", repr=False)

    # Control plane
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port: must be in 1..65535, got {self.port}")
        if self.block_tokens < 1 or self.block_tokens > 4096:
            raise ValueError(f"--block-tokens: must be in 1..4096, got {self.block_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport: must be one of {', '.join(TRANSPORTS)}")
        if self.kv_memory_bytes <= 0:
            raise ValueError("--kv-memory: must be positive")
        if self.store_memory_bytes <= 0:
            raise ValueError("--memory: must be positive")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size: must be at least 1")
        if self.prefill_chunk_tokens < self.block_tokens:
            raise ValueError("--prefill-chunk: must be at least --block-tokens")
        if self.role in ("prefill", "decode", "store") and not self.conductor_url:
            raise ValueError(f"--conductor-url: required for --role {self.role}")

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
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
