"""Mooncake's `mooncake.mooncake_config` names, from mooncake-server's implementation."""

from mooncake_server.mooncake_api.config import MooncakeConfig  # noqa: F401 - re-exported
