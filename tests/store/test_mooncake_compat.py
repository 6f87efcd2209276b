"""compat/mooncake-store-api: `mooncake.store` importable under Mooncake's name on purpose, and
refused beside Mooncake's own wheel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent
COMPAT = ROOT / "compat" / "mooncake-store-api"


def test_installed_it_gives_engines_mooncake_store_backed_by_ours(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(tmp_path), str(COMPAT)], check=True)
    code = ("from mooncake.store import MooncakeDistributedStore, ReplicateConfig\n"
            "from mooncake.mooncake_config import MooncakeConfig\n"
            "print(MooncakeDistributedStore.__module__, ReplicateConfig().replica_num)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == ["mooncake_server.mooncake_api.store", "1"]
    # Nothing in the main package answers to Mooncake's name.
    assert not list((ROOT / "mooncake_server").glob("**/mooncake/store.py"))


def test_installing_it_beside_mooncakes_wheel_is_refused() -> None:
    ref = Path(os.environ.get("MOONCAKE_REF_PYTHON", ROOT / ".venv-mooncake-ref/bin/python"))
    if not ref.exists():
        pytest.skip(f"Mooncake's wheel is not installed ({ref} missing: scripts/setup.sh --test)")
    run = subprocess.run([str(ref), "-m", "pip", "install", "--no-deps", "--no-index",
                          "--no-build-isolation",
                          str(COMPAT)], capture_output=True, text=True)
    assert run.returncode != 0
    assert "refusing to install beside mooncake-transfer-engine-non-cuda" in run.stdout + \
        run.stderr
    check = subprocess.run([str(ref), "-c", "import mooncake.store, sys; "
                            "sys.exit('mooncake_server' in repr(mooncake.store))"])
    assert check.returncode == 0  # the real wheel's package is untouched
