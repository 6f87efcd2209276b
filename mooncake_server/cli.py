"""`mooncake-server --role ROLE`: parse flags (and an optional YAML file) once, start the role."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mooncake_server.config import ROLES, TRANSPORTS, ServerConfig, load_yaml, parse_size

log = logging.getLogger(__name__)

# flag -> (config field, type, help). Flags default to None so YAML values are not overridden.
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--host", "host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", "port", int, "HTTP port of this role (default 8000)"),
    ("--advertise-host", "advertise_host", str, "host other roles use to reach this one"),
    ("--conductor-url", "conductor_url", str, "conductor base URL (prefill/decode/store)"),
    ("--instance-id", "instance_id", str, "id in the conductor's registry"),
    ("--model", "model", str, "HF model path or id (default: bundled SmolLM2-135M-Instruct)"),
    ("--served-model-name", "served_model_name", str, "name clients pass as `model`"),
    ("--dtype", "dtype", str, "auto | float32 | bfloat16 | float16"),
    ("--block-tokens", "block_tokens", int, "tokens per KV block (default 16)"),
    ("--max-model-len", "max_model_len", int, "context window (default: the model's)"),
    ("--kv-memory", "kv_memory_bytes", str, "KV cache size of an engine role, e.g. 1GiB"),
    ("--max-batch-size", "max_batch_size", int, "most sequences per decode step (default 32)"),
    ("--prefill-chunk", "prefill_chunk_tokens", int, "prompt tokens per forward pass"),
    ("--torch-threads", "torch_threads", int, "torch intra-op threads"),
    ("--memory", "store_memory_bytes", str, "store DRAM pool size, e.g. 8GiB"),
    ("--transfer-port", "transfer_port", int, "transfer engine port (0 = any)"),
    ("--transport", "transport", str, f"transfer transport: {' | '.join(TRANSPORTS)}"),
    ("--transfer-timeout", "transfer_timeout_s", float, "seconds before a transfer fails"),
    ("--cluster-secret", "cluster_secret", str,
     "shared secret of internal endpoints (or env MOONCAKE_CLUSTER_SECRET)"),
    ("--heartbeat-interval", "heartbeat_interval_s", float, "seconds between heartbeats"),
    ("--heartbeat-timeout", "heartbeat_timeout_s", float, "seconds before an instance is dead"),
    ("--log-level", "log_level", str, "debug | info | warning | error"),
]
_SIZE_FIELDS = {"kv_memory_bytes": "--kv-memory", "store_memory_bytes": "--memory"}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="mooncake-server",
        description="KVCache-centric disaggregated LLM serving (Mooncake architecture).")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="which role this process runs (default: all)")
    p.add_argument("--config", default=None, help="YAML file of flag values (flags win)")
    for flag, dest, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    return p


def parse_config(argv: Sequence[str] | None = None,
                 environ: dict[str, str] | None = None) -> ServerConfig:
    """Flags > YAML > MOONCAKE_* environment > defaults, validated into one frozen config."""
    args = build_parser().parse_args(argv)
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if env.get("MOONCAKE_CLUSTER_SECRET"):
        values["cluster_secret"] = env["MOONCAKE_CLUSTER_SECRET"]
    if args.config:
        by_flag = {flag[2:].replace("-", "_"): dest for flag, dest, _, _ in _FLAGS}
        values.update({by_flag.get(k, k): v for k, v in load_yaml(args.config).items()})
    for key, val in vars(args).items():
        if key != "config" and val is not None:
            values[key] = val
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config: unknown setting(s) {', '.join(unknown)}")
    for field, flag in _SIZE_FIELDS.items():
        if field in values:
            values[field] = parse_size(values[field], flag)
    return ServerConfig(**values)


def run(config: ServerConfig) -> None:
    """Start the configured role and block until it stops."""
    from mooncake_server.logs import setup_logging

    setup_logging(config.role, config.log_level)
    if config.role == "all":
        from mooncake_server.roles.all import run_all

        run_all(config)
        return
    import uvicorn

    from mooncake_server.roles import app_for_role

    app = app_for_role(config)
    uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                  log_level=config.log_level, access_log=False,
                                  timeout_graceful_shutdown=5,
                                  lifespan="on")).run()


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: bad flags exit 2 with one clear line."""
    try:
        config = parse_config(argv)
    except ValueError as exc:
        print(f"mooncake-server: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except KeyboardInterrupt:
        pass
