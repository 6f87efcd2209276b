"""One module per role; `app_for_role` picks the HTTP app of a single-role process."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mooncake_server.config import ServerConfig


def app_for_role(config: ServerConfig) -> FastAPI:
    """Build the FastAPI app of `config.role` (not `all`, which supervises processes)."""
    module = import_module(f"mooncake_server.roles.{config.role}")
    return module.build_app(config)
