"""Transport selection: the per-peer rule (shm > rdma > tcp), RDMA discovery (pyverbs or the
native probe; no device means one log line and shm/TCP), and forced transports that cannot be
honoured failing clearly. No RDMA NIC can exist on these machines: the data path over RDMA is
exercised on a cluster with NICs (docs/transfer.md, "RDMA on a cluster with NICs")."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest
from transfer_helpers import SECRET, Peer

from mooncake_server.transfer import (
    TransferEngine,
    TransferError,
    _native,
    pick_transport,
    probe_rdma_devices,
)


@pytest.mark.parametrize(("requested", "same_host", "rdma_local", "rdma_peer", "picked"), [
    ("auto", True, True, True, "shm"),     # same host beats any NIC
    ("auto", False, True, True, "rdma"),   # remote peer, both ends have RDMA
    ("auto", False, True, False, "tcp"),   # the peer has no RDMA for this segment
    ("auto", False, False, True, "tcp"),   # no local device
    ("auto", False, False, False, "tcp"),
    ("tcp", True, True, True, "tcp"),      # forced transports win when possible
    ("shm", True, False, False, "shm"),
    ("rdma", True, True, True, "rdma"),
])
def test_pick_transport(requested: str, same_host: bool, rdma_local: bool, rdma_peer: bool,
                        picked: str) -> None:
    assert pick_transport(requested, same_host=same_host, rdma_local=rdma_local,
                          rdma_peer=rdma_peer) == picked


@pytest.mark.parametrize(("requested", "rdma_local", "rdma_peer", "why"), [
    ("shm", True, True, "shared memory is not possible"),
    ("rdma", False, True, "no RDMA device open"),
    ("rdma", True, False, "peer serves this segment without RDMA"),
])
def test_forced_transport_that_cannot_work_is_refused(requested: str, rdma_local: bool,
                                                      rdma_peer: bool, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        pick_transport(requested, same_host=False, rdma_local=rdma_local, rdma_peer=rdma_peer)


@pytest.fixture
def fake_pyverbs(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in pyverbs (discovery only) so both discovery paths run on any machine."""
    pkg, device = types.ModuleType("pyverbs"), types.ModuleType("pyverbs.device")
    pkg.device = device  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)
    yield device


@pytest.mark.skipif(not _native.RDMA_BUILT, reason="built without infiniband/verbs.h")
def test_discovery_prefers_pyverbs(fake_pyverbs: types.ModuleType) -> None:
    fake_pyverbs.get_device_list = lambda: [types.SimpleNamespace(name=b"mlx5_0"),  # type: ignore[attr-defined]
                                            types.SimpleNamespace(name=b"mlx5_1")]
    assert probe_rdma_devices() == (("mlx5_0", "mlx5_1"), "", "pyverbs")

    def enosys() -> list[object]:
        raise OSError(38, "Failed to get devices list")  # what pyverbs raises on this kernel

    fake_pyverbs.get_device_list = enosys  # type: ignore[attr-defined]
    probe = probe_rdma_devices()
    assert probe.devices == () and "Failed to get devices list" in probe.reason


def test_native_probe_without_pyverbs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import fails -> native probe
    probe = probe_rdma_devices()
    assert probe.source == "native"
    if not probe.devices:  # this kernel: ibv_get_device_list() is NULL with ENOSYS
        assert probe.reason


def _no_rdma_here() -> bool:
    return not probe_rdma_devices().devices


@pytest.mark.skipif(not _no_rdma_here(), reason="this host has an RDMA device")
def test_forcing_rdma_without_a_device_fails_clearly() -> None:
    with pytest.raises(TransferError, match="transport 'rdma' is not available: .+"):
        TransferEngine(secret=SECRET, transport="rdma")


@pytest.mark.skipif(not _no_rdma_here(), reason="this host has an RDMA device")
def test_auto_without_a_device_logs_one_line_and_uses_tcp(caplog: pytest.LogCaptureFixture,
                                                          peer: Peer) -> None:
    with (caplog.at_level(logging.INFO, logger="mooncake_server.transfer"),
          TransferEngine(secret=SECRET, serve=False) as client):
        assert client.rdma_device is None
        handle = client.open_segment(peer.address, "plain")  # not shareable: no shm
        assert client.transport_of(handle) == "tcp"
        assert "no local RDMA device" in client.fallback_reason(handle)
    lines = [r for r in caplog.records if "RDMA" in r.getMessage()]
    assert len(lines) == 1 and "no RDMA device" in lines[0].getMessage()


def test_tcp_and_shm_engines_never_touch_rdma(caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> None:
        raise AssertionError("probed for RDMA although the transport was forced")

    monkeypatch.setattr("mooncake_server.transfer.transports.probe_rdma_devices", boom)
    for transport in ("tcp", "shm"):
        with TransferEngine(secret=SECRET, transport=transport, serve=False) as engine:
            assert engine.rdma_device is None


def test_named_device_that_does_not_exist_is_refused() -> None:
    if not _native.RDMA_BUILT:
        pytest.skip("built without infiniband/verbs.h: rdma_device is never opened")
    with pytest.raises(TransferError, match="not available"):
        TransferEngine(secret=SECRET, transport="rdma", rdma_device="no_such_nic0")
