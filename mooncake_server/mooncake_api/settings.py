"""A Mooncake store client's settings, read as Mooncake reads them: `setup`'s arguments (seven
positional, an eighth `engine`, keywords, or one dict), the JSON file at `MOONCAKE_CONFIG_PATH`,
or the `MOONCAKE_*` environment variables; plus the cluster secret (`MOONCAKE_CLUSTER_SECRET`),
which Mooncake does not have and our master and store nodes require.

Sizes are ints or strings such as "4gb" or "512MB", in Mooncake's units (k/m/g/t = 1024^n).
`metadata_server` is accepted in each of Mooncake's forms (`P2PHANDSHAKE`,
`http://host:port/metadata`, `etcd://...`) and not needed: our store master says where every
segment is, so the client only talks to `master_server_address`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

DEFAULT_GLOBAL_SEGMENT_SIZE = 16 << 20  # setup()'s defaults in the real wheel
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20
DEFAULT_MASTER = "127.0.0.1:50051"
_UNITS = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40), ("k", 1 << 10),
          ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))
# setup()'s positional order, as the real wheel's.
POSITIONAL = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
              "protocol", "rdma_devices", "master_server_addr", "engine")
# Other spellings the integrations and config files use for the same settings.
_ALIASES = {"device_name": "rdma_devices", "master_server_address": "master_server_addr",
            "te_meta_data_server": "metadata_server"}
# setup() keywords of the real wheel this client accepts and has no use for.
IGNORED = frozenset({"ipc_socket_path", "enable_ssd_offload", "ssd_offload_path", "tenant_id",
                     "enable_client_http_server", "client_http_port"})
PROTOCOLS = ("tcp", "rdma", "shm", "auto")  # Mooncake's two, and this engine's own two


def parse_size(value: object, what: str) -> int:
    """Bytes from an int or a size string in Mooncake's units; ValueError naming `what`."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: not a size: {value!r}")
    if isinstance(value, int):
        size = value
    else:
        text, mult = str(value).strip().lower(), 1
        for unit, m in _UNITS:
            if text.endswith(unit):
                text, mult = text[:-len(unit)].strip(), m
                break
        try:
            size = int(float(text) * mult)
        except ValueError:
            raise ValueError(f"{what}: cannot parse size {value!r} (e.g. 4gb, 512mb)") from None
    if size < 0:
        raise ValueError(f"{what}: must not be negative, got {value!r}")
    return size


@dataclass(frozen=True)
class ClientSettings:
    """Everything `MooncakeDistributedStore.setup` decides, validated."""

    local_hostname: str = "localhost"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    protocol: str = "tcp"
    rdma_devices: str = ""
    master_server_addr: str = DEFAULT_MASTER
    secret: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not self.local_hostname:
            raise ValueError("local_hostname: must not be empty")
        self.master_url  # noqa: B018 - parses (raises ValueError)

    @property
    def host(self) -> str:
        """The host part of local_hostname (what this client's engine listens on)."""
        host, _, port = self.local_hostname.rpartition(":")
        return host if host and port.isdigit() else self.local_hostname

    @property
    def port(self) -> int:
        """The port part of local_hostname (0: any free port)."""
        _, _, port = self.local_hostname.rpartition(":")
        return int(port) if port.isdigit() else 0

    @property
    def master_url(self) -> str:
        """The store master as an http:// base URL."""
        addr = self.master_server_addr.strip()
        if addr.startswith("etcd://"):
            raise ValueError("master_server_addr: an etcd:// master (Mooncake's HA mode) is not "
                             "supported: give the standalone master's HOST:PORT")
        url = addr if "://" in addr else f"http://{addr}"
        host, _, port = url.split("://", 1)[1].rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master_server_addr: expected HOST:PORT, got {addr!r}")
        return url.rstrip("/")


def from_setup_args(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                    environ: Mapping[str, str] | None = None) -> tuple[ClientSettings, Any]:
    """Settings (and the `engine` argument, if any) from setup's positional, keyword or dict
    form; the secret from `MOONCAKE_CLUSTER_SECRET` unless given."""
    env = os.environ if environ is None else environ
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        values = dict(args[0])
    else:
        if len(args) > len(POSITIONAL):
            raise ValueError(f"setup: at most {len(POSITIONAL)} positional arguments, got "
                             f"{len(args)}")
        values = dict(zip(POSITIONAL, args))
        for key, value in kwargs.items():
            if key in values:
                raise ValueError(f"setup: {key} given twice")
            values[key] = value
    engine = values.pop("engine", None)
    return _settings(values, env), engine


def from_config(config: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                ) -> ClientSettings:
    """Settings from a Mooncake JSON config's keys (`MooncakeConfig.from_file`'s)."""
    return _settings(dict(config), os.environ if environ is None else environ)


def from_environment(environ: Mapping[str, str] | None = None) -> ClientSettings:
    """Settings as Mooncake's `MooncakeConfig.load_from_env`: the JSON file at
    `MOONCAKE_CONFIG_PATH`, else `MOONCAKE_MASTER` and the other `MOONCAKE_*` variables."""
    env = os.environ if environ is None else environ
    path = env.get("MOONCAKE_CONFIG_PATH")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"MOONCAKE_CONFIG_PATH: cannot read {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"MOONCAKE_CONFIG_PATH: {path} must hold a JSON object")
        return from_config(config, env)
    if not env.get("MOONCAKE_MASTER"):
        raise ValueError("neither MOONCAKE_CONFIG_PATH nor MOONCAKE_MASTER is set")
    values: dict[str, Any] = {"master_server_addr": env["MOONCAKE_MASTER"]}
    for var, key in (("MOONCAKE_LOCAL_HOSTNAME", "local_hostname"),
                     ("MOONCAKE_TE_META_DATA_SERVER", "metadata_server"),
                     ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
                     ("MOONCAKE_LOCAL_BUFFER_SIZE", "local_buffer_size"),
                     ("MOONCAKE_PROTOCOL", "protocol"), ("MOONCAKE_DEVICE", "rdma_devices")):
        if env.get(var):
            values[key] = env[var]
    return _settings(values, env)


def _settings(values: dict[str, Any], env: Mapping[str, str]) -> ClientSettings:
    known = {f.name for f in fields(ClientSettings)}
    out: dict[str, Any] = {}
    for key, value in values.items():
        key = _ALIASES.get(key, key)
        if key in IGNORED or value is None:
            continue
        if key == "cluster_secret":
            key = "secret"
        if key not in known:
            raise ValueError(f"setup: unknown setting {key!r}")
        out[key] = value
    for key in ("global_segment_size", "local_buffer_size"):
        if key in out:
            out[key] = parse_size(out[key], key)
    if "protocol" in out:
        out["protocol"] = str(out["protocol"]).lower()
    out.setdefault("secret", env.get("MOONCAKE_CLUSTER_SECRET", ""))
    return replace(ClientSettings(), **{k: (v if isinstance(v, int) else str(v))
                                        for k, v in out.items()})
