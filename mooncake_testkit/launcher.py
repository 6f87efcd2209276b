"""`mooncake-server --role all` (or any single-process configuration) on free local ports, as
one `RoleProc` (e2e tests, benchmarks, trace replay)."""

from __future__ import annotations

import os
import secrets
import signal
import sys
from dataclasses import dataclass

from mooncake_testkit.ports import free_port_block
from mooncake_testkit.role_procs import STARTUP_TIMEOUT_S, RoleProc


@dataclass
class Cluster:
    """A running `mooncake-server` process tree."""

    proc: RoleProc
    secret: str = ""  # the cluster secret, for reading internal roles' /metrics

    @property
    def port(self) -> int:
        """Port of the public API (children of `--role all` listen on the next ones)."""
        return self.proc.port

    @property
    def internal_headers(self) -> dict[str, str]:
        """Headers that internal endpoints (and internal roles' /metrics) accept."""
        from mooncake_server.wire.auth import secret_headers

        return secret_headers(self.secret)

    @property
    def url(self) -> str:
        """Base URL of the public API."""
        return self.proc.url

    def role_url(self, offset: int) -> str:
        """Base URL of a child role (--role all puts them on port+1..3)."""
        return f"http://127.0.0.1:{self.port + offset}"

    def stop(self) -> int | None:
        """Ctrl-C the supervisor and wait for it (then SIGKILL the tree); its exit code."""
        return self.proc.stop(60, sig=signal.SIGINT)


def start_cluster(role: str, extra: list[str] | None = None) -> Cluster:
    """Start `mooncake-server --role ROLE` on free ports and wait until /health answers 200."""
    port = free_port_block(5)
    argv = [sys.executable, "-m", "mooncake_server", "--role", role, "--port", str(port),
            "--kv-memory", "512MiB", "--memory", "1GiB",
            # float32 is the exact mode tests compare with HF; `extra` may override it
            "--dtype", "float32", *(extra or [])]
    secret = secrets.token_hex(16)
    env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": secret}
    cluster = Cluster(RoleProc(role, role, "127.0.0.1", port, argv, env, inherit_output=True),
                      secret)
    cluster.proc.start()
    try:
        cluster.proc.wait_healthy(STARTUP_TIMEOUT_S)
    except BaseException:
        cluster.stop()
        raise
    return cluster
