"""`mooncake-server --role ROLE`: parse flags (and an optional YAML file) once, start the role."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mooncake_server.config import ServerConfig, flags, load_yaml, parse_size
from mooncake_server.malloc_tuning import keep_freed_memory, restart_with_huge_pages

log = logging.getLogger(__name__)

# Roles serving internal endpoints to other processes: they refuse to start without a secret.
_CLUSTER_ROLES = ("conductor", "prefill", "decode", "store", "master")
# Environment variable -> setting (the only place MOONCAKE_* variables are read).
_ENV = (("MOONCAKE_CLUSTER_SECRET", "cluster_secret"),
        ("MOONCAKE_CLUSTER_SECRET_FILE", "cluster_secret_file"),
        ("MOONCAKE_API_KEY", "api_key"),
        ("MOONCAKE_ETCD_PASSWORD", "etcd_password"))


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface: one flag per ServerConfig field (config.flags())."""
    p = argparse.ArgumentParser(
        prog="mooncake-server",
        description="KVCache-centric disaggregated LLM serving (Mooncake architecture).",
        epilog="`mooncake-server profile --help`: measure the model for the conductor's --profile.")
    p.add_argument("--config", default=None, help="YAML file of flag values (flags win)")
    p.add_argument("--cluster-secret-file", dest="cluster_secret_file", default=None,
                   help="file holding the cluster secret (or env MOONCAKE_CLUSTER_SECRET_FILE)")
    hints = typing.get_type_hints(ServerConfig)
    # NOTE: flags default to None so that they do not override YAML or environment values.
    for name, flag in flags():
        kind = _value_type(hints[name])
        if kind is bool:
            p.add_argument(flag.name, dest=name, action="store_true", default=None,
                           help=flag.help)
        else:
            p.add_argument(flag.name, dest=name, type=str if flag.size else kind,
                           choices=flag.choices, default=None, help=flag.help)
    return p


def _value_type(hint: Any) -> type:
    """str, int, float or bool: the type a field holds, `X | None` read as X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    if kind not in (str, int, float, bool):
        raise TypeError(f"ServerConfig: no flag type for {hint!r}")
    return kind


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
        by_flag = {flag.name[2:].replace("-", "_"): name for name, flag in flags()}
        _merge(values, {by_flag.get(k, k): v for k, v in load_yaml(args.config).items()})
    _merge(values, {key: val for key, val in vars(args).items()
                    if key != "config" and val is not None})
    known = {name for name, _ in flags()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config: unknown setting(s) {', '.join(unknown)}")
    if values.get("role") == "master":
        values.setdefault("port", 50051)  # mooncake_master's port
    for name, flag in flags():
        if flag.size and name in values:
            values[name] = parse_size(values[name], flag.name)
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
    from mooncake_server.instance.drain import DrainingServer
    from mooncake_server.instance.http_server import server_config
    from mooncake_server.roles import app_for_role

    app = app_for_role(config)
    # NOTE: SIGTERM first drains the role (its app.state.drain), then uvicorn shuts down.
    DrainingServer(server_config(app, host=config.host, port=config.port, log_config=None,
                                 log_level=config.log_level, access_log=False,
                                 timeout_graceful_shutdown=5, lifespan="on"), app).run()


def _profile(argv: list[str]) -> None:
    """`mooncake-server profile ...`: measure the model, write the cost model for --profile."""
    from mooncake_server import profiling

    try:
        args, rest = profiling.build_parser().parse_known_args(argv)
        # The model flags (--model, --dtype, --block-tokens ...) are the server's own.
        profiling.run(args, parse_config(["--role", "colocated", *rest]))
    except ValueError as exc:
        print(f"mooncake-server profile: error: {exc}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: bad flags exit 2 with one clear line."""
    if argv is None:  # a real command line (tests call main with argv in their own process)
        restart_with_huge_pages()
    keep_freed_memory()  # NOTE: first: it must precede every thread
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
