"""The native sources build with libibverbs headers (RDMA compiled in) and without them (stubs),
and setup.py detects which case it is in. Syntax-only compiles: a few hundred milliseconds."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
VERBS_H = Path("/usr/include/infiniband/verbs.h")


def _setup_module() -> object:
    spec = importlib.util.spec_from_file_location("mooncake_setup", ROOT / "setup.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself only runs under __main__
    return module


def _compile(*flags: str) -> subprocess.CompletedProcess[str]:
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    cmd = [*cc, "-fsyntax-only", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
           "-Werror", *flags, f"-I{NATIVE}", f"-I{sysconfig.get_paths()['include']}",
           *sorted(str(p) for p in NATIVE.glob("*.c"))]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)


@pytest.fixture
def hidden_verbs(tmp_path: Path) -> Path:
    """An include dir whose infiniband/verbs.h refuses to compile: the header is 'absent'."""
    (tmp_path / "infiniband").mkdir()
    (tmp_path / "infiniband" / "verbs.h").write_text('#error "infiniband/verbs.h is hidden"\n')
    return tmp_path


pytestmark = pytest.mark.skipif(shutil.which(shlex.split(
    sysconfig.get_config_var("CC") or "cc")[0]) is None, reason="no C compiler")


def test_builds_without_verbs_header(hidden_verbs: Path) -> None:
    assert not _setup_module().has_verbs([str(hidden_verbs)])  # type: ignore[attr-defined]
    result = _compile(f"-I{hidden_verbs}")
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not VERBS_H.exists(), reason="libibverbs-dev is not installed "
                    "(scripts/setup.sh --test installs it)")
def test_builds_with_verbs_header() -> None:
    assert _setup_module().has_verbs()  # type: ignore[attr-defined]
    result = _compile("-DTE_HAVE_VERBS=1")
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not VERBS_H.exists(), reason="libibverbs-dev is not installed")
def test_installed_extension_has_rdma_compiled_in() -> None:
    from mooncake_server.transfer import _native

    assert _native.RDMA_BUILT
