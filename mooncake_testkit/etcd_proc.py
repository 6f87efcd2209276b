"""A real etcd (Debian's `etcd-server`) on loopback ports, for tests of `--etcd` discovery.

It can be stopped and started again on the same ports and data directory, as an outage would
look to the cluster (leases survive in the data directory, as in production).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mooncake_testkit.ports import free_port_block

ETCD_BINARY = "etcd"


def etcd_available() -> bool:
    """True where the etcd binary is installed (tests skip, with the reason, where not)."""
    return shutil.which(ETCD_BINARY) is not None


@dataclass
class EtcdProc:
    """One single-member etcd listening on 127.0.0.1 only."""

    data_dir: Path
    log_path: Path | None = None
    client_port: int = field(default_factory=lambda: free_port_block(2))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """What `--etcd` takes."""
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> EtcdProc:
        """Start etcd and wait until it answers /health."""
        peer = f"http://127.0.0.1:{self.client_port + 1}"
        argv = [ETCD_BINARY, "--name", "test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--log-level", "warn"]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} ({self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).json().get("health") == "true":
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within {timeout_s:.0f} s")
            time.sleep(0.1)

    def running(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL past `timeout_s`)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
