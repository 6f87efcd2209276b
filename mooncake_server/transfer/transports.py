"""Transport selection for the transfer engine: names, the per-peer choice, RDMA discovery.

Per segment, `auto` picks shared memory (peer on the same host) > RDMA (a local device and a peer
that registered the segment with its NIC) > TCP; a forced transport that cannot be used is an
error. RDMA devices are discovered at run time: pyverbs where importable, else the native probe.
No device (none present, a kernel without RDMA where ibv_get_device_list fails with ENOSYS, or a
build without libibverbs) means one log line and shm/TCP; `transport="rdma"` then fails clearly.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import mooncake_server.transfer._native as _native
from mooncake_server.transfer.errors import TransferError

logger = logging.getLogger(__name__)

MODES = {"auto": _native.MODE_AUTO, "shm": _native.MODE_SHM, "tcp": _native.MODE_TCP,
         "rdma": _native.MODE_RDMA}
TRANSPORT_NAMES = {_native.TRANSPORT_SHM: "shm", _native.TRANSPORT_TCP: "tcp",
                   _native.TRANSPORT_RDMA: "rdma"}


class RdmaProbe(NamedTuple):
    """RDMA devices found at run time, or why there are none."""

    devices: tuple[str, ...]
    reason: str  # empty when devices were found
    source: str  # "pyverbs" or "native"


def pick_transport(requested: str, *, same_host: bool, rdma_local: bool,
                   rdma_peer: bool) -> str:
    """The transport open_segment uses for a peer (the native engine's own rule).

    Args:
        requested: "auto", "shm", "tcp" or "rdma".
        same_host: the peer's segment can be mapped here (shared memory on this host).
        rdma_local: this engine has an RDMA device open.
        rdma_peer: the peer registered the segment with its RDMA device.
    Returns:
        "shm", "rdma" or "tcp". Raises ValueError when a forced transport cannot be used.
    """
    if requested not in MODES:
        raise ValueError(f"transport must be one of {', '.join(MODES)}; got {requested!r}")
    t = _native.pick_transport(MODES[requested], same_host, rdma_local, rdma_peer)
    return TRANSPORT_NAMES[t]


def probe_rdma_devices() -> RdmaProbe:
    """RDMA device names on this host: pyverbs when importable, else libibverbs via native."""
    if not _native.RDMA_BUILT:
        return RdmaProbe((), "this build has no RDMA support (infiniband/verbs.h was absent when "
                             "it was compiled: install libibverbs-dev and reinstall)", "native")
    try:
        from pyverbs.device import get_device_list  # type: ignore[import-not-found]
    except ImportError:
        names, reason = _native.rdma_probe()
        return RdmaProbe(tuple(names), reason, "native")
    try:
        found = get_device_list()
    except Exception as exc:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError (ENOSYS) and kin
        return RdmaProbe((), f"pyverbs: {exc}", "pyverbs")
    found_names = tuple(_device_name(d) for d in found)
    return RdmaProbe(found_names, "" if found_names else "no RDMA devices found", "pyverbs")


def open_rdma(native_engine: Any, transport: str, device: str | None,
              gid_index: int) -> str | None:
    """Open an RDMA device on a fresh native engine when `transport` allows one.

    Returns the device name, or None (logged once) when `auto` finds no usable device; raises
    TransferError when `transport="rdma"` cannot be honoured.
    """
    if transport not in ("auto", "rdma"):
        return None
    forced = transport == "rdma"
    probe = probe_rdma_devices()
    if not probe.devices and (device is None or not _native.RDMA_BUILT):
        if forced:
            raise TransferError("", f"transport 'rdma' is not available: {probe.reason}")
        logger.info("no RDMA device (%s, probed via %s): transfers use shared memory or TCP",
                    probe.reason, probe.source)
        return None
    name = device if device is not None else probe.devices[0]
    try:
        opened: str = native_engine.enable_rdma(name, gid_index, forced)
    except _native.NativeError as exc:
        if forced:
            raise TransferError("", f"transport 'rdma' is not available: {exc}") from None
        logger.warning("RDMA device %s is unusable (%s): transfers use shared memory or TCP",
                       name, exc)
        return None
    logger.info("RDMA device %s open: remote peers with RDMA use one-sided READ/WRITE", opened)
    return opened


def _device_name(device: Any) -> str:
    """A pyverbs device entry's name as text."""
    name = getattr(device, "name", device)
    return name.decode() if isinstance(name, bytes) else str(name)
