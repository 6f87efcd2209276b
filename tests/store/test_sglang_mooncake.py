"""The engines' own code: SGLang 0.5.23's HiCache `MooncakeStore` backend, unmodified, on CPU,
against a real standalone master and store node. `sglang_harness.py` builds SGLang's real host
KV pools (MHA page-first: one buffer per object; MLA layer-first: one object from several
buffers), creates the backend through SGLang's StorageBackendFactory (its setup and warm-up),
then writes pages and reads them back into other pages, bit-identical, checks existence, its
key formats, re-sets and misses, and clear() (remove_all).

SGLang runs in its own environment, `.venv-sglang` (scripts/setup_integrations.sh), with our
compat `mooncake.store` first on its path; skipped, with the reason, where that is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from mooncake_rig import store_only

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_sglangs_mooncake_backend_stores_and_reads_back_kv_pages() -> None:
    venv = Path(os.environ.get("MOONCAKE_SGLANG_VENV", ROOT / ".venv-sglang"))
    if not (venv / ".ready").exists():
        pytest.skip(f"SGLang's environment is not set up ({venv}: scripts/setup_integrations.sh)")
    with store_only(1, "256MiB", "--default-kv-lease-ttl", "1000") as cluster:
        env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": cluster.secret,
               "PYTHONPATH": os.pathsep.join([str(venv / "compat"), str(ROOT)])}
        run = subprocess.run([str(venv / "bin/python"), "-W", "ignore",
                              str(HERE / "sglang_harness.py"), "--master", cluster.master_addr,
                              "--metadata", "P2PHANDSHAKE", "--segment-size", str(64 << 20),
                              "--lease-wait", "1.5"],
                             env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    lines = run.stdout.splitlines()
    assert f"mooncake.store = {venv / 'compat/mooncake/store.py'}" in run.stdout
    assert [line for line in lines if line.startswith("FAIL")] == [], run.stderr[-3000:]
    assert "29 passed, 0 failed" in lines and run.returncode == 0
    for part in ("mha", "mla"):
        assert f"PASS: [{part}] read-back bytes bit-identical" in run.stdout
