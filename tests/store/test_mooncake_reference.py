"""Side by side with the real thing: one scripted sequence of Mooncake store calls (puts,
duplicate put, missing keys, batch and multi-buffer calls, removes under a lease, remove_all,
sizes) against Mooncake's own wheel and master and against ours, with the same answers.

The wheel (`mooncake-transfer-engine-non-cuda==0.3.13.post1`) lives in its own environment,
`.venv-mooncake-ref` (scripts/setup.sh --test makes it; MOONCAKE_REF_PYTHON names another),
because it owns the `mooncake` package. Its master binds wildcard addresses, so it runs in a
private network namespace (`unshare -n`, root). Where it cannot run, the test is skipped with
the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mooncake_rig import store_only

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SEQUENCE = HERE / "mooncake_sequence.py"


def reference_python() -> Path:
    """The Python of the environment that holds Mooncake's wheel, or skip saying why not."""
    python = Path(os.environ.get("MOONCAKE_REF_PYTHON", ROOT / ".venv-mooncake-ref/bin/python"))
    if not python.exists():
        pytest.skip(f"Mooncake's wheel is not installed ({python} missing: scripts/setup.sh "
                    "--test makes it)")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("Mooncake's master binds wildcard addresses: needs root and unshare(1) to "
                    "run it in a private network namespace")
    return python


def test_the_same_calls_get_the_same_answers_from_mooncake_and_from_us() -> None:
    python = reference_python()
    master = python.parent / "mooncake_master"
    script = (f"ip link set lo up; {master} --rpc_port=50051 --rpc_address=127.0.0.1 "
              "--default_kv_lease_ttl=5000 </dev/null >/dev/null 2>&1 & m=$!; "
              "for i in $(seq 200); do (echo > /dev/tcp/127.0.0.1/50051) 2>/dev/null && break; "
              f"sleep 0.05; done; {python} {SEQUENCE} mooncake.store 127.0.0.1:50051 67108864; "
              "rc=$?; kill $m; wait $m; exit $rc")
    ref = subprocess.run(["unshare", "-n", "bash", "-c", script], capture_output=True,
                         text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr[-2000:]
    theirs = json.loads(ref.stdout.strip().splitlines()[-1])
    with store_only(1, "64MiB") as cluster:
        env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": cluster.secret}
        run = subprocess.run([sys.executable, str(SEQUENCE), "mooncake_server.mooncake_api",
                              cluster.master_addr, "0"], capture_output=True, text=True,
                             env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(ours) == len(theirs) > 40
    differ = [(label, t, o) for (label, t), (_, o) in zip(theirs, ours) if t != o]
    assert differ == [], differ


def test_missing_surface_is_printed() -> None:
    python = reference_python()
    names = subprocess.run([python, "-c", "from mooncake.store import MooncakeDistributedStore "
                            "as S; print(' '.join(n for n in dir(S) if not n.startswith('_')))"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.split()
    from mooncake_server.mooncake_api import MooncakeDistributedStore

    missing = sorted(set(names) - set(dir(MooncakeDistributedStore)))
    print(f"Mooncake's MooncakeDistributedStore methods we do not have ({len(missing)}):",
          " ".join(missing))
    # Every method the integrations call, and the rest without tensor or GPU in its name that
    # docs/store-integrations.md does not list as missing.
    documented = (ROOT / "docs/store-integrations.md").read_text()
    undocumented = [n for n in missing if "tensor" not in n and "cuda" not in n
                    and f"`{n}`" not in documented]
    assert undocumented == []
