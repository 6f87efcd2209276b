"""`MooncakeConfig`: Mooncake's client configuration object (`mooncake.mooncake_config`), read
from the JSON file at MOONCAKE_CONFIG_PATH or the MOONCAKE_* variables (settings.py parses)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mooncake_server.mooncake_api import settings as _settings


@dataclass
class MooncakeConfig:
    """The fields a Mooncake JSON config holds, sizes in bytes."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str
    master_server_address: str

    @staticmethod
    def _of(s: _settings.ClientSettings) -> MooncakeConfig:
        return MooncakeConfig(s.local_hostname, s.metadata_server, s.global_segment_size,
                              s.local_buffer_size, s.protocol, s.rdma_devices,
                              s.master_server_addr)

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Read a Mooncake JSON config file."""
        with open(file_path, encoding="utf-8") as f:
            config: dict[str, Any] = json.load(f)
        return MooncakeConfig._of(_settings.from_config(config))

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """MOONCAKE_CONFIG_PATH's file, else MOONCAKE_MASTER and the other MOONCAKE_* vars."""
        return MooncakeConfig._of(_settings.from_environment())

    def setup_args(self) -> tuple[Any, ...]:
        """The seven positional arguments of `MooncakeDistributedStore.setup`."""
        return (self.local_hostname, self.metadata_server, self.global_segment_size,
                self.local_buffer_size, self.protocol, self.device_name,
                self.master_server_address)
