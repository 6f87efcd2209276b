"""`mooncake-server --role ROLE`: parse flags (and an optional YAML file) once, start the role."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
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
    ("--dtype", "dtype", str,
     "auto (default: bfloat16 where the CPU has AMX/AVX512-BF16, else float32) | float32 | "
     "bfloat16 | float16; float32 is the exact mode"),
    ("--quantization", "quantization", str,
     "auto (default: int8 on CPUs without bf16 hardware) | none | int8 (weight-only int8 "
     "linears)"),
    ("--block-tokens", "block_tokens", int, "tokens per KV block (default 16)"),
    ("--max-model-len", "max_model_len", int, "context window (default: the model's)"),
    ("--kv-memory", "kv_memory_bytes", str, "KV cache size of an engine role, e.g. 1GiB"),
    ("--max-batch-size", "max_batch_size", int, "most sequences per decode step (default 32)"),
    ("--prefill-chunk", "prefill_chunk_tokens", int, "prompt tokens per forward pass"),
    ("--decode-chunk", "decode_chunk_tokens", int,
     "colocated: prompt tokens per forward pass while sequences decode in it (default 256)"),
    ("--torch-threads", "torch_threads", int,
     "torch intra-op threads, fixed (default: taken from the shared core budget per step)"),
    ("--cpu-budget", "cpu_budget", int,
     "cores the engine processes of one machine share, lent to whichever has work "
     "(default: all cores)"),
    ("--cpu-share", "cpu_share_path", str,
     "file the engine processes of one machine share --cpu-budget through (--role all sets it)"),
    ("--kv-write", "kv_write", str,
     "prefill: `layer` streams each layer's KV to the store as soon as it is computed; "
     "`after` writes whole blocks once the forward pass is done; `auto` (default) streams "
     "layers only where the copies do not take the forward's cores (RDMA, or --torch-threads "
     "below the core count)"),
    ("--memory", "store_memory_bytes", str, "store DRAM pool size, e.g. 8GiB"),
    ("--ssd-dir", "store_ssd_dir", str, "store SSD tier directory (default: no SSD tier)"),
    ("--ssd-capacity", "store_ssd_capacity_bytes", str, "store SSD tier size, e.g. 64GiB"),
    ("--demote-after", "store_demote_after_s", float,
     "seconds an untouched store object stays in DRAM before moving to SSD (default 300)"),
    ("--high-watermark", "store_high_watermark", float,
     "store DRAM fraction above which LRU eviction starts (default 0.95)"),
    ("--replicas", "store_replicas", int, "copies of each KV block across store nodes (conductor)"),
    ("--transfer-port", "transfer_port", int, "transfer engine port (0 = any)"),
    ("--store-control-port", "store_control_port", int,
     "store: port of the binary control channel clients use for put/get/exists (0 = any)"),
    ("--index-control-port", "index_control_port", int,
     "conductor: port of the binary channel store nodes send index reports on (0 = any)"),
    ("--transport", "transport", str, f"transfer transport: {' | '.join(TRANSPORTS)}"),
    ("--transfer-timeout", "transfer_timeout_s", float, "seconds before a transfer fails"),
    ("--cluster-secret", "cluster_secret", str,
     "shared secret of internal endpoints (or env MOONCAKE_CLUSTER_SECRET)"),
    ("--api-key", "api_key", str,
     "require `Authorization: Bearer KEY` on /v1/* and /metrics (or env MOONCAKE_API_KEY)"),
    ("--max-request-size", "max_request_bytes", str,
     "largest /v1 request body, e.g. 8MiB (default; larger ones get 413)"),
    ("--max-messages", "max_messages", int, "most chat messages per request (default 2048)"),
    ("--max-prompt-tokens", "max_prompt_tokens", int,
     "most prompt tokens per request (default: the context window)"),
    ("--max-tokens-limit", "max_tokens_limit", int,
     "largest max_tokens a request may ask for (default: the context window)"),
    ("--max-stop", "max_stop_sequences", int, "most stop sequences per request (default 4)"),
    ("--max-stop-chars", "max_stop_chars", int, "longest stop sequence (default 256 chars)"),
    ("--log-prompts", "log_prompts", bool, "log every request's prompt (off by default)"),
    ("--heartbeat-interval", "heartbeat_interval_s", float, "seconds between heartbeats"),
    ("--heartbeat-timeout", "heartbeat_timeout_s", float, "seconds before an instance is dead"),
    ("--drain-timeout", "drain_timeout_s", float,
     "seconds a SIGTERM'd instance may finish its running work before it exits (default 30)"),
    ("--failover-wait", "failover_wait_s", float,
     "conductor: seconds to wait for a live instance to move a request to (default 30)"),
    ("--policy", "policy", str,
     "conductor's placement: random | load | cache-local | cache-global (default)"),
    ("--ttft-slo", "ttft_slo_s", float,
     "seconds; reject (429) requests whose estimated time to first token exceeds it"),
    ("--tbt-slo", "tbt_slo_s", float,
     "seconds; reject (429) requests whose estimated time between tokens exceeds it"),
    ("--profile", "profile_path", str,
     "cost model from `mooncake-server profile` (default: built-in coefficients)"),
    ("--log-level", "log_level", str, "debug | info | warning | error"),
]
_SIZE_FIELDS = {"kv_memory_bytes": "--kv-memory", "store_memory_bytes": "--memory",
                "store_ssd_capacity_bytes": "--ssd-capacity",
                "max_request_bytes": "--max-request-size"}
# Roles serving internal endpoints to other processes: they refuse to start without a secret.
_CLUSTER_ROLES = ("conductor", "prefill", "decode", "store")
# Environment variable -> setting (the only place MOONCAKE_* variables are read).
_ENV = (("MOONCAKE_CLUSTER_SECRET", "cluster_secret"),
        ("MOONCAKE_CLUSTER_SECRET_FILE", "cluster_secret_file"),
        ("MOONCAKE_API_KEY", "api_key"))


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="mooncake-server",
        description="KVCache-centric disaggregated LLM serving (Mooncake architecture).",
        epilog="`mooncake-server profile --help`: measure the model for the conductor's --profile.")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="which role this process runs (default: all)")
    p.add_argument("--config", default=None, help="YAML file of flag values (flags win)")
    p.add_argument("--cluster-secret-file", dest="cluster_secret_file", default=None,
                   help="file holding the cluster secret (or env MOONCAKE_CLUSTER_SECRET_FILE)")
    for flag, dest, typ, help_ in _FLAGS:
        if typ is bool:
            p.add_argument(flag, dest=dest, action="store_true", default=None, help=help_)
        else:
            p.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    return p


def read_secret_file(path: str) -> str:
    """The cluster secret stored in `path` (surrounding whitespace dropped)."""
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--cluster-secret-file: cannot read {path}: {exc}") from None
    if not secret:
        raise ValueError(f"--cluster-secret-file: {path} is empty")
    return secret


def _merge(values: dict[str, Any], source: dict[str, Any]) -> None:
    """Add one source's settings over `values`; a secret file there becomes its secret."""
    source = dict(source)
    path = source.pop("cluster_secret_file", None)
    if path is not None:
        if source.get("cluster_secret"):
            raise ValueError("--cluster-secret-file: give the secret or a file holding it, "
                             "not both")
        source["cluster_secret"] = read_secret_file(str(path))
    values.update(source)


def parse_config(argv: Sequence[str] | None = None,
                 environ: dict[str, str] | None = None) -> ServerConfig:
    """Flags > YAML > MOONCAKE_* environment > defaults, validated into one frozen config."""
    args = build_parser().parse_args(argv)
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    _merge(values, {key: env[var] for var, key in _ENV if env.get(var)})
    if args.config:
        by_flag = {flag[2:].replace("-", "_"): dest for flag, dest, _, _ in _FLAGS}
        _merge(values, {by_flag.get(k, k): v for k, v in load_yaml(args.config).items()})
    _merge(values, {key: val for key, val in vars(args).items()
                    if key != "config" and val is not None})
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config: unknown setting(s) {', '.join(unknown)}")
    for field, flag in _SIZE_FIELDS.items():
        if field in values:
            values[field] = parse_size(values[field], flag)
    return ServerConfig(**values)


def check_can_start(config: ServerConfig) -> None:
    """Refuse to run a cluster role whose internal endpoints would be open to anyone."""
    if config.role in _CLUSTER_ROLES and not config.cluster_secret:
        raise ValueError(
            f"--cluster-secret: required for --role {config.role} (or --cluster-secret-file, "
            "MOONCAKE_CLUSTER_SECRET): without it anyone could register instances or read and "
            "write the store")


def run(config: ServerConfig) -> None:
    """Start the configured role and block until it stops."""
    from mooncake_server.logs import setup_logging

    setup_logging(config.role, config.log_level)
    if config.role == "all":
        from mooncake_server.roles.all.supervisor import run_all

        run_all(config)
        return
    import uvicorn

    from mooncake_server.instance.drain import DrainingServer
    from mooncake_server.roles import app_for_role

    app = app_for_role(config)
    # NOTE: SIGTERM first drains the role (its app.state.drain), then uvicorn shuts down.
    DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                  log_level=config.log_level, access_log=False,
                                  timeout_graceful_shutdown=5,
                                  lifespan="on"), app).run()


def _profile(argv: list[str]) -> None:
    """`mooncake-server profile ...`: measure the model, write the cost model for --profile."""
    from mooncake_server.profiling import main as profile_main

    try:
        profile_main(argv)
    except ValueError as exc:
        print(f"mooncake-server profile: error: {exc}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: bad flags exit 2 with one clear line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["profile"]:
        _profile(args[1:])
        return
    try:
        config = parse_config(args)
        check_can_start(config)
    except ValueError as exc:
        print(f"mooncake-server: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except KeyboardInterrupt:
        pass
