"""A cluster of separately started roles with the real model: a conductor, two store nodes
(`--replicas 2`), two prefill and two decode instances, each its own OS process, so any of them
can be killed, stopped, drained and restarted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_testkit.role_procs import RoleCluster

# Short heartbeats: a silent instance is declared dead within ~2 s.
HEARTBEAT = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2"]
ENGINE = ["--kv-memory", "256MiB", "--torch-threads", "1", "--transfer-timeout", "3"]


def build_cluster(log_dir: Path) -> RoleCluster:
    """Declare the 7 processes (not started)."""
    cluster = RoleCluster(log_dir=log_dir, common=[*HEARTBEAT, "--log-level", "warning"])
    cluster.add("conductor", "conductor", "--replicas", "2", "--failover-wait", "30",
                "--drain-timeout", "30")
    for i in range(2):
        cluster.add("store", f"store-{i}", "--memory", "256MiB")
    for i in range(2):
        cluster.add("prefill", f"prefill-{i}", *ENGINE)
        cluster.add("decode", f"decode-{i}", *ENGINE, "--drain-timeout", "60")
    return cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoleCluster]:
    """The running cluster; every role is running again when a test ends."""
    with build_cluster(tmp_path_factory.mktemp("faults-logs")) as running:
        running.start()
        yield running
