"""One typed configuration for every role, parsed once at the edge (cli.py) and passed down."""

from __future__ import annotations

import dataclasses
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("conductor", "prefill", "decode", "store", "master", "all", "colocated")
TRANSPORTS = ("auto", "shm", "tcp", "rdma")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8-weights", "int8")
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


# Which processes read a field: the roles that run one. `--role all` is no reader of its own: it
# forwards each field to those of its children (conductor, store, prefill, decode) that read it.
CONDUCTOR, PREFILL, DECODE, STORE, COLOCATED, MASTER = ("conductor", "prefill", "decode",
                                                        "store", "colocated", "master")
EVERY_ROLE = (CONDUCTOR, PREFILL, DECODE, STORE, COLOCATED, MASTER)
ENGINES = (PREFILL, DECODE, COLOCATED)  # the roles that run the model
MEMBERS = (PREFILL, DECODE, STORE)  # the roles that register with a conductor
TRANSFERRING = (PREFILL, DECODE, STORE)  # the roles that run a transfer engine
API_ROLES = (CONDUCTOR, COLOCATED)  # the roles serving the public OpenAI API


@dataclass(frozen=True)
class Flag:
    """How one ServerConfig field is set on the command line, and which roles read it."""

    name: str  # e.g. "--kv-memory"
    help: str
    roles: frozenset[str]
    size: bool = False  # a byte size such as 8GiB, read by parse_size
    choices: tuple[str, ...] | None = None

    def argv(self, value: Any) -> list[str]:
        """The command-line words that set this field to `value` (none for None or False)."""
        if value is None or value is False:
            return []
        return [self.name] if value is True else [self.name, str(value)]


def _setting(default: Any, flag: str, help: str, roles: tuple[str, ...], *, size: bool = False,
             choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """A ServerConfig field declaring its flag (the one table the CLI and `--role all` use)."""
    meta = {"flag": Flag(flag, help, frozenset(roles), size, choices)}
    return field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class ServerConfig:
    """Everything a role needs; frozen so no code path can change it after start-up.

    Each field declares its flag, its help and the roles that read it (see `flags()`).
    """

    role: str = _setting("all", "--role", "which role this process runs (default: all)",
                         EVERY_ROLE, choices=ROLES)
    host: str = _setting("127.0.0.1", "--host", "address to listen on (default 127.0.0.1)",
                         EVERY_ROLE)
    port: int = _setting(8000, "--port", "HTTP port of this role (default 8000)", EVERY_ROLE)
    # Where this role can be reached by others; defaults to host.
    advertise_host: str | None = _setting(None, "--advertise-host",
                                          "host other roles use to reach this one", EVERY_ROLE)
    conductor_url: str | None = _setting(None, "--conductor-url",
                                         "conductor base URL (prefill/decode/store)", MEMBERS)
    instance_id: str | None = _setting(None, "--instance-id", "id in the conductor's registry",
                                       MEMBERS)
    # A store master of its own (`--role master`); None = the conductor runs one inside itself.
    master_url: str | None = _setting(
        None, "--master",
        "HOST:PORT or URL of a standalone store master (`--role master`): store nodes register "
        "and report there, engines and the conductor ask it where blocks live (default: the "
        "conductor's own)", (CONDUCTOR, *MEMBERS))

    # Model
    # NOTE: the conductor reads the model's config (context window, KV bytes per token) and
    # tokenizer; the store never touches the model.
    model: str | None = _setting(
        None, "--model", "HF model path or id (default: bundled SmolLM2-135M-Instruct)",
        (CONDUCTOR, *ENGINES))
    served_model_name: str | None = _setting(None, "--served-model-name",
                                             "name clients pass as `model`", (CONDUCTOR, *ENGINES))
    # auto = float32 activations and KV, linears by the CPU's flags; the conductor namespaces
    # block keys by it and sizes the built-in cost model's KV bytes with it.
    dtype: str = _setting(
        "auto", "--dtype",
        "auto (default: float32 activations and KV, int8 weights in groups of 32 where the CPU "
        "has AVX2+FMA) | float32 | bfloat16 | float16; float32 is the exact mode",
        (CONDUCTOR, *ENGINES))
    quantization: str = _setting(
        "auto", "--quantization",
        "auto (default: auto's kernel under --dtype auto, plain linears under a dtype given "
        "by hand) | none | int8-weights (weight-only, groups of 32) | int8 (dynamic int8 "
        "linears, per-channel weights)", ENGINES)
    block_tokens: int = _setting(16, "--block-tokens", "tokens per KV block (default 16)",
                                 (CONDUCTOR, *ENGINES))
    # None = the model's max_position_embeddings
    max_model_len: int | None = _setting(None, "--max-model-len",
                                         "context window (default: the model's)",
                                         (CONDUCTOR, *ENGINES))

    # Engine (prefill / decode / colocated)
    kv_memory_bytes: int = _setting(1 << 30, "--kv-memory",
                                    "KV cache size of an engine role, e.g. 1GiB", ENGINES,
                                    size=True)
    max_batch_size: int = _setting(32, "--max-batch-size",
                                   "most sequences per decode step (default 32)",
                                   (DECODE, COLOCATED))
    prefill_chunk_tokens: int = _setting(2048, "--prefill-chunk", "prompt tokens per forward pass",
                                         ENGINES)
    # Colocated: prompt tokens a forward pass may carry while sequences are decoding in it, so a
    # token gap stays near one decode step while long prompts arrive.
    decode_chunk_tokens: int = _setting(
        256, "--decode-chunk",
        "prompt tokens per forward pass while sequences decode (colocated: in it; prefill: "
        "on the same cores) (default 256)",
        ENGINES)
    # None = the shared core budget decides, step by step
    torch_threads: int | None = _setting(
        None, "--torch-threads",
        "torch intra-op threads, fixed (default: taken from the shared core budget per step)",
        ENGINES)
    # Cores the engine processes of this machine share (`--role all`); None = all of them.
    cpu_budget: int | None = _setting(
        None, "--cpu-budget",
        "cores the engine processes of one machine take turns on, one forward pass at a time "
        "(default: all cores)", ENGINES)
    # The board the engine processes of one machine share the budget on (`--role all` sets it).
    cpu_share_path: str | None = _setting(
        None, "--cpu-share",
        "file the engine processes of one machine share --cpu-budget through (--role all sets "
        "it)", ENGINES)
    # prefill: stream each layer's KV to the store | write after the forward | auto (see prefill)
    kv_write: str = _setting(
        "auto", "--kv-write",
        "prefill: `layer` streams each layer's KV to the store as soon as it is computed; "
        "`after` writes whole blocks once the forward pass is done; `auto` (default) streams "
        "layers only where the copies do not take the forward's cores (RDMA, or --torch-threads "
        "below the core count)", (PREFILL,))

    # Store
    store_memory_bytes: int = _setting(2 << 30, "--memory", "store DRAM pool size, e.g. 8GiB",
                                       (STORE,), size=True)
    store_ssd_dir: str | None = _setting(None, "--ssd-dir",
                                         "store SSD tier directory (default: no SSD tier)",
                                         (STORE,))
    store_ssd_capacity_bytes: int = _setting(64 << 30, "--ssd-capacity",
                                             "store SSD tier size, e.g. 64GiB", (STORE,), size=True)
    # idle objects move from DRAM to SSD after this long
    store_demote_after_s: float = _setting(
        300.0, "--demote-after",
        "seconds an untouched store object stays in DRAM before moving to SSD (default 300)",
        (STORE,))
    store_high_watermark: float = _setting(
        0.95, "--high-watermark",
        "store DRAM fraction above which LRU eviction starts (default 0.95)", (STORE,))
    # copies of each block across store nodes: the conductor's placement decides them
    store_replicas: int = _setting(1, "--replicas",
                                   "copies of each KV block across store nodes (store master)",
                                   (CONDUCTOR, MASTER))
    kv_lease_ttl_ms: int = _setting(
        5000, "--default-kv-lease-ttl",
        "store master: milliseconds a key read through the Mooncake store API stays leased "
        "(a remove without force is refused meanwhile; default 5000, as mooncake_master)",
        (CONDUCTOR, MASTER))

    # Transfer engine
    transfer_port: int = _setting(0, "--transfer-port", "transfer engine port (0 = any)",
                                  TRANSFERRING)
    store_control_port: int = _setting(
        0, "--store-control-port",
        "store: port of the binary control channel clients use for put/get/exists (0 = any)",
        (STORE,))
    index_control_port: int = _setting(
        0, "--index-control-port",
        "store master: port of the binary channel store nodes send index reports on (0 = any)",
        (CONDUCTOR, MASTER))
    transport: str = _setting("auto", "--transport",
                              f"transfer transport: {' | '.join(TRANSPORTS)}",
                              TRANSFERRING)
    transfer_timeout_s: float = _setting(10.0, "--transfer-timeout",
                                         "seconds before a transfer fails", TRANSFERRING)
    cluster_secret: str = _setting(
        "", "--cluster-secret",
        "shared secret of internal endpoints (or env MOONCAKE_CLUSTER_SECRET)", EVERY_ROLE,
        secret=True)

    # Public API: who may call it and how big a request may be
    api_key: str = _setting(  # "" = the public API is open
        "", "--api-key",
        "require `Authorization: Bearer KEY` on /v1/* and /metrics (or env MOONCAKE_API_KEY)",
        API_ROLES, secret=True)
    max_request_bytes: int = _setting(  # body size of a /v1 request (413 above)
        8 << 20, "--max-request-size",
        "largest /v1 request body, e.g. 8MiB (default; larger ones get 413)", API_ROLES,
        size=True)
    max_messages: int = _setting(  # OpenAI's own limit
        2048, "--max-messages", "most chat messages per request (default 2048)", API_ROLES)
    max_prompt_tokens: int | None = _setting(  # None = the context window
        None, "--max-prompt-tokens", "most prompt tokens per request (default: the context window)",
        API_ROLES)
    max_tokens_limit: int | None = _setting(  # None = the context window
        None, "--max-tokens-limit",
        "largest max_tokens a request may ask for (default: the context window)", API_ROLES)
    max_stop_sequences: int = _setting(  # OpenAI's own limit
        4, "--max-stop", "most stop sequences per request (default 4)", API_ROLES)
    max_stop_chars: int = _setting(256, "--max-stop-chars",
                                   "longest stop sequence (default 256 chars)", API_ROLES)
    max_n: int = _setting(8, "--max-n", "most choices (n) per request (default 8)", API_ROLES)
    log_prompts: bool = _setting(  # prompts never reach the logs unless asked
        False, "--log-prompts", "log every request's prompt (off by default)", API_ROLES)

    # Control plane
    heartbeat_interval_s: float = _setting(1.0, "--heartbeat-interval",
                                           "seconds between heartbeats", MEMBERS)
    heartbeat_timeout_s: float = _setting(5.0, "--heartbeat-timeout",
                                          "seconds before an instance is dead",
                                          (CONDUCTOR, MASTER))
    request_timeout_s: float = _setting(
        600.0, "--request-timeout",
        "conductor: seconds to wait on a prefill or decode instance's reply (or its stream's next "
        "bytes) before the request fails (default 600)",
        (CONDUCTOR,))
    # Faults: how long a SIGTERM'd instance may finish its work; how long the conductor waits
    # for a live instance to move a request to when the one serving it died.
    drain_timeout_s: float = _setting(
        30.0, "--drain-timeout",
        "seconds a SIGTERM'd instance may finish its running work before it exits (default 30)",
        MEMBERS)
    failover_wait_s: float = _setting(
        30.0, "--failover-wait",
        "conductor: seconds to wait for a live instance to move a request to (default 30)",
        (CONDUCTOR,))

    # Discovery on etcd (optional): instances publish themselves under a lease, conductors
    # watch; without --etcd the conductor's own registry is all there is (as before).
    etcd_endpoints: str | None = _setting(
        None, "--etcd",
        "etcd endpoints, e.g. http://10.0.0.5:2379[,...]: instances publish, conductors watch "
        "(default: no etcd)", (CONDUCTOR, *MEMBERS, MASTER))
    etcd_prefix: str = _setting("/mooncake/", "--etcd-prefix",
                                "key prefix of this cluster in etcd (default /mooncake/)",
                                (CONDUCTOR, *MEMBERS, MASTER))
    etcd_lease_ttl_s: int = _setting(
        5, "--etcd-lease-ttl",
        "seconds a silent process's key stays in etcd (default 5)", (CONDUCTOR, *MEMBERS, MASTER))
    etcd_ca_cert: str | None = _setting(None, "--etcd-ca-cert", "PEM CA file: talk TLS to etcd",
                                        (CONDUCTOR, *MEMBERS, MASTER))
    etcd_cert: str | None = _setting(None, "--etcd-cert", "PEM client certificate (mTLS)",
                                     (CONDUCTOR, *MEMBERS, MASTER))
    etcd_key: str | None = _setting(None, "--etcd-key", "PEM client key (mTLS)",
                                    (CONDUCTOR, *MEMBERS, MASTER))
    etcd_user: str | None = _setting(None, "--etcd-user", "etcd user (auth enabled)",
                                     (CONDUCTOR, *MEMBERS, MASTER))
    etcd_password: str = _setting(
        "", "--etcd-password", "etcd user's password (or env MOONCAKE_ETCD_PASSWORD)",
        (CONDUCTOR, *MEMBERS, MASTER), secret=True)

    # Scheduling (conductor): Algorithm 1 policy, SLOs for early rejection, the cost model;
    # decode's admission control checks the TBT SLO with the same cost model.
    policy: str = _setting(
        "cache-global", "--policy",
        "conductor's placement: random | load | cache-local | cache-global (default)",
        (CONDUCTOR,))
    ttft_slo_s: float | None = _setting(  # None = never reject on TTFT
        None, "--ttft-slo",
        "seconds; reject (429) requests whose estimated time to first token exceeds it",
        (CONDUCTOR, COLOCATED))
    tbt_slo_s: float | None = _setting(  # None = never reject on TBT
        None, "--tbt-slo",
        "seconds; reject (429) requests whose estimated time between tokens exceeds it "
        "(prefill: passes beside a decode are sized to fit half of it; colocated: its passes "
        "beside decoding rows fit it)",
        (CONDUCTOR, PREFILL, DECODE, COLOCATED))
    profile_path: str | None = _setting(  # None = built-in model
        None, "--profile",
        "cost model from `mooncake-server profile` (default: built-in coefficients)",
        (CONDUCTOR, PREFILL, DECODE, COLOCATED))
    log_level: str = _setting("info", "--log-level", "debug | info | warning | error",
                              EVERY_ROLE)

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
        self._check_discovery()

    def _check_discovery(self) -> None:
        if self.role == "store" and self.master_url:
            pass  # registers and reports with the standalone master
        elif (self.role in ("prefill", "decode", "store") and not self.conductor_url
                and not self.etcd_endpoints):
            raise ValueError(f"--conductor-url: required for --role {self.role} (or --etcd)")
        if self.master_url is not None:
            self.master_base  # noqa: B018 - parses (raises ValueError naming --master)
        if self.kv_lease_ttl_ms < 0:
            raise ValueError(f"--default-kv-lease-ttl: must not be negative (ms), got "
                             f"{self.kv_lease_ttl_ms}")
        if self.etcd_endpoints is not None:
            self.etcd_targets  # noqa: B018 - parses (raises ValueError naming --etcd)
        if not self.etcd_prefix.startswith("/") or not self.etcd_prefix.endswith("/"):
            raise ValueError(f"--etcd-prefix: must start and end with '/', got "
                             f"{self.etcd_prefix!r}")
        if self.etcd_lease_ttl_s < 2:
            raise ValueError(f"--etcd-lease-ttl: must be at least 2 (seconds), got "
                             f"{self.etcd_lease_ttl_s}")
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise ValueError("--etcd-cert and --etcd-key: give both or neither")
        if self.etcd_cert is not None and self.etcd_ca_cert is None:
            raise ValueError("--etcd-cert: needs --etcd-ca-cert (mTLS runs over TLS)")
        if self.etcd_password and not self.etcd_user:
            raise ValueError("--etcd-password: needs --etcd-user")

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
        if self.max_n < 1:
            raise ValueError(f"--max-n: must be at least 1, got {self.max_n}")
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
    def conductor_urls(self) -> tuple[str, ...]:
        """The conductors named by --conductor-url (a comma-separated list is allowed)."""
        text = self.conductor_url or ""
        return tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())

    @property
    def master_base(self) -> str | None:
        """The --master store master as an http:// base URL (HOST:PORT alone is accepted)."""
        text = (self.master_url or "").strip().rstrip("/")
        if not text:
            return None
        url = text if "://" in text else f"http://{text}"
        host, _, port = url.split("://", 1)[1].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--master: expected HOST:PORT or http://HOST:PORT, got "
                             f"{self.master_url!r}")
        return url

    @property
    def etcd_targets(self) -> tuple[tuple[str, int], ...]:
        """(host, port) of each --etcd endpoint; empty without --etcd."""
        targets = []
        for word in (self.etcd_endpoints or "").split(","):
            word = word.strip()
            if not word:
                continue
            hostport = word.split("://", 1)[-1].rstrip("/")
            host, _, port = hostport.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--etcd: expected http://HOST:PORT[,...], got {word!r}")
            targets.append((host.strip("[]"), int(port)))
        if self.etcd_endpoints is not None and not targets:
            raise ValueError("--etcd: no endpoint given")
        return tuple(targets)

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


def flags() -> list[tuple[str, Flag]]:
    """(field name, flag) of every ServerConfig field, in declaration (= --help) order."""
    return [(f.name, f.metadata["flag"]) for f in dataclasses.fields(ServerConfig)]


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into flag-name -> value (dashes or underscores accepted)."""
    import yaml  # type: ignore[import-untyped]

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
