"""A real etcd (Debian's etcd-server) on a loopback port, for the discovery tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_testkit.etcd_proc import EtcdProc, etcd_available


@pytest.fixture
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProc]:
    """A fresh etcd per test (its data kept across a stop and start within the test)."""
    if not etcd_available():
        pytest.skip("needs etcd (Debian etcd-server)")
    base = tmp_path_factory.mktemp("etcd")
    proc = EtcdProc(base / "data", base / "etcd.log").start()
    try:
        yield proc
    finally:
        proc.stop()
