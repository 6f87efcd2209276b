"""The engines' own code: LMCache 0.5.6's `mooncakestore://` remote connector, unmodified, on
CPU, against a real standalone master and store node. `lmcache_harness.py` builds LMCache's
real engine config, metadata and LocalCPUBackend, creates the connector through LMCache's
CreateConnector, and in both of its modes (KV header stored with the data: put_parts /
batch_get_buffer; zero-copy: put_from / batch_put_from / batch_get_into from the backend's
registered buffer) writes KV chunks and reads them back bit-identical, checks existence, the
hit-prefix count, a miss, a partial chunk, and close().

LMCache runs in its own environment, `.venv-lmcache` (scripts/setup_integrations.sh), with our
compat `mooncake.store` first on its path; skipped, with the reason, where that is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from mooncake_rig import store_only

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_lmcaches_mooncakestore_connector_stores_and_reads_back_kv_chunks() -> None:
    """LMCache's connector, both modes, against one master and store node: no FAIL lines."""
    venv = Path(os.environ.get("MOONCAKE_LMCACHE_VENV", ROOT / ".venv-lmcache"))
    if not (venv / ".ready").exists():
        pytest.skip(f"LMCache's environment is not set up ({venv}: scripts/setup_integrations.sh)")
    with store_only(1, "256MiB") as cluster:
        # LMCache's usage telemetry is off: nothing here leaves 127.0.0.1.
        env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": cluster.secret,
               "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
               "PYTHONPATH": os.pathsep.join([str(venv / "compat"), str(ROOT)])}
        run = subprocess.run([str(venv / "bin/python"), "-W", "ignore",
                              str(HERE / "lmcache_harness.py"), "--master", cluster.master_addr,
                              "--metadata", "P2PHANDSHAKE", "--segment-size", str(64 << 20)],
                             env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    lines = run.stdout.splitlines()
    assert f"mooncake.store = {venv / 'compat/mooncake/store.py'}" in run.stdout
    assert [line for line in lines if line.startswith("FAIL")] == [], run.stderr[-3000:]
    assert "24 passed, 0 failed" in lines and run.returncode == 0
    for part in ("meta", "zerocopy"):
        assert f"PASS: [{part}] read-back bytes bit-identical" in run.stdout
