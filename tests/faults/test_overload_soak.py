"""scripts/overload.py and scripts/soak.py, shortened, against one real cluster: past its
sustainable rate the conductor rejects early (429 + Retry-After) and fails nothing; after both
runs nothing is left in flight, leased, reserved or pinned, and no role's private memory grew."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from mooncake_testkit.role_procs import RoleCluster

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MiB = 1 << 20
TTFT_SLO, TBT_SLO = 3.0, 1.0


def load_script(name: str) -> ModuleType:
    """Import scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def overload() -> ModuleType:
    return load_script("overload")


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return load_script("soak")


@pytest.fixture(scope="module")
def slo_cluster(overload: ModuleType, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[RoleCluster]:
    with overload.launch(TTFT_SLO, TBT_SLO, tmp_path_factory.mktemp("overload-logs")) as c:
        yield c


def private_growth(before: dict[str, dict[str, int]],
                   after: dict[str, dict[str, int]]) -> dict[str, float]:
    """Private (anonymous) RSS growth per role, MiB."""
    return {name: (after[name]["anon"] - b["anon"]) / MiB for name, b in before.items()}


def test_soak_of_short_requests_leaks_nothing(soak: ModuleType,
                                              slo_cluster: RoleCluster) -> None:
    r = soak.run_soak(slo_cluster, requests=60, concurrency=4, max_tokens=4, warmup=8)
    assert r.failed == 0, r.errors
    assert r.leftovers == {}
    assert all(g < 32 for g in private_growth(r.memory_before, r.memory_after).values())
