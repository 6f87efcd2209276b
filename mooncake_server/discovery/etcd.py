"""The one module that touches the etcd client library (etcd3aio, the `etcd` extra).

`EtcdSession` is the small surface the rest of discovery uses: leases, put/delete, a prefix
listing and a prefix watch. Every call is bounded by `call_timeout_s`, so a lost etcd shows as
`EtcdUnavailable` within that time, never as a hung task.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from mooncake_server.config import ServerConfig

PUT, DELETE = "put", "delete"


class EtcdUnavailable(Exception):
    """etcd did not answer (down, unreachable, or refused the call)."""


class KeyEvent(NamedTuple):
    """One change under a watched prefix: `kind` is PUT or DELETE (value b"" then)."""

    kind: str
    key: str
    value: bytes


class Listing(NamedTuple):
    """Every key under a prefix at `revision` (watch from revision + 1 to miss nothing)."""

    revision: int
    items: dict[str, bytes]


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is and how to talk to it (from --etcd, --etcd-* flags)."""

    targets: tuple[tuple[str, int], ...]
    prefix: str
    lease_ttl_s: int
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str = field(default="", repr=False)
    secret: str = field(default="", repr=False)  # the cluster secret: seals every value
    call_timeout_s: float = 2.0

    @classmethod
    def from_config(cls, config: ServerConfig) -> EtcdSettings | None:
        """The settings of `config`, None without --etcd."""
        if not config.etcd_endpoints:
            return None
        return cls(config.etcd_targets, config.etcd_prefix, config.etcd_lease_ttl_s,
                   config.etcd_ca_cert, config.etcd_cert, config.etcd_key, config.etcd_user,
                   config.etcd_password, config.cluster_secret)

    def instance_key(self, role: str, instance_id: str) -> str:
        """Key of one instance's InstanceInfo."""
        return f"{self.prefix}instances/{role}/{instance_id}"

    @property
    def instances_prefix(self) -> str:
        """Prefix of every instance key."""
        return f"{self.prefix}instances/"

    def conductor_key(self, conductor_id: str) -> str:
        """Key of one conductor's ConductorInfo."""
        return f"{self.prefix}conductors/{conductor_id}"

    def master_key(self, master_id: str) -> str:
        """Where a standalone store master publishes itself."""
        return f"{self.prefix}masters/{master_id}"

    @property
    def conductors_prefix(self) -> str:
        """Prefix of every conductor key."""
        return f"{self.prefix}conductors/"


def _import_client() -> Any:
    try:
        import etcd3aio
    except ImportError as exc:  # the extra is optional: only --etcd needs it
        raise ImportError("--etcd needs the etcd client: pip install 'mooncake-server[etcd]'"
                          ) from exc
    return etcd3aio


def _endpoints(targets: tuple[tuple[str, int], ...]) -> list[str]:
    # NOTE: the library dials `ipv4:` targets (one channel, round robin), so names are resolved
    # here (blocking: run in a thread); a name that does not resolve is a clear error.
    out = []
    for host, port in targets:
        try:
            addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as exc:
            raise EtcdUnavailable(f"--etcd: cannot resolve {host}: {exc}") from None
        out.append(f"{addr}:{port}")
    return out


class EtcdSession:
    """One gRPC channel to etcd (auto-reconnecting underneath) and the calls discovery needs."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._lib = _import_client()
        self._client: Any = None
        self._timeout = settings.call_timeout_s

    async def connect(self) -> None:
        """Open the channel (TLS and auth as configured); cheap: nothing is sent yet."""
        s = self.settings
        endpoints = await asyncio.to_thread(_endpoints, s.targets)
        tls: dict[str, Any] = {}
        if s.ca_cert:
            tls["ca_cert"] = Path(s.ca_cert).read_bytes()
            if s.cert and s.key:
                tls["cert_chain"] = Path(s.cert).read_bytes()
                tls["cert_key"] = Path(s.key).read_bytes()
            tls["tls_server_name"] = s.targets[0][0]
        # NOTE: one attempt per call (callers retry on their own schedule); a watch re-dials
        # within a second of etcd coming back, not after the library's default 5 s backoff.
        self._client = self._lib.Etcd3Client(
            endpoints, rpc_max_attempts=1, watch_reconnect_backoff_seconds=0.1,
            watch_max_reconnect_backoff_seconds=1.0, **tls)
        await self._client.connect()
        if s.user:
            await self._authenticate()

    async def _authenticate(self) -> None:
        try:
            reply = await asyncio.wait_for(
                self._client.auth.authenticate(self.settings.user, self.settings.password),
                self._timeout)
        except Exception as exc:  # noqa: BLE001 - any failure means no token
            raise EtcdUnavailable(f"etcd authentication failed: {exc!r}") from None
        self._client.set_token(reply.token)

    async def close(self) -> None:
        """Close the channel."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _call(self, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except self._lib.EtcdUnauthenticatedError as exc:
            if self.settings.user:  # NOTE: the token expired: a fresh one for the retry
                await self._authenticate()
            raise EtcdUnavailable(repr(exc)) from None
        except (TimeoutError, self._lib.EtcdError) as exc:
            raise EtcdUnavailable(repr(exc)) from None
        except Exception as exc:
            if type(exc).__module__.startswith("grpc"):
                raise EtcdUnavailable(repr(exc)) from None
            raise

    async def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        reply = await self._call(self._client.lease.grant(ttl=ttl_s))
        return int(reply.ID)

    async def keep_alive(self, lease_id: int) -> int:
        """Renew a lease once; its TTL now (0 or less: the lease is gone)."""
        async def once() -> int:
            stream = self._client.lease.keep_alive(lease_id)
            try:
                async for reply in stream:
                    return int(reply.TTL)
                return 0
            finally:
                stream.cancel()

        return int(await self._call(once()))

    async def revoke(self, lease_id: int) -> None:
        """End a lease now: its keys vanish at once."""
        await self._call(self._client.lease.revoke(lease_id))

    async def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        """Write `key` (held by `lease_id`, if given)."""
        await self._call(self._client.kv.put(key, value, lease=lease_id))

    async def list(self, prefix: str) -> Listing:
        """Every key under `prefix`, with the revision it was read at."""
        from etcd3aio.kv import prefix_range_end

        reply = await self._call(self._client.kv.get(prefix, range_end=prefix_range_end(prefix)))
        return Listing(int(reply.header.revision),
                       {kv.key.decode(): bytes(kv.value) for kv in reply.kvs})

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[KeyEvent]]:
        """Batches of changes under `prefix` from `start_revision` on; ends (returns) if etcd
        cancels the watch (e.g. that revision was compacted): list again, then watch again."""
        from etcd3aio.kv import prefix_range_end

        stream = self._client.watch.watch(prefix, range_end=prefix_range_end(prefix),
                                          start_revision=start_revision)
        try:
            async for reply in stream:
                if reply.canceled or reply.compact_revision > 0:
                    return
                batch = [KeyEvent(DELETE if ev.type == 1 else PUT, ev.kv.key.decode(),
                                  bytes(ev.kv.value)) for ev in reply.events]
                if batch:
                    yield batch
        except self._lib.EtcdError as exc:
            raise EtcdUnavailable(repr(exc)) from None
        except Exception as exc:
            if type(exc).__module__.startswith("grpc"):
                raise EtcdUnavailable(repr(exc)) from None
            raise
        finally:
            await stream.aclose()
