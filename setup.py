"""Build the native transfer engine and the linear kernels; metadata lives in pyproject.toml.

The RDMA transport is compiled in only where `infiniband/verbs.h` is present (Debian:
libibverbs-dev); elsewhere native/te_rdma.c builds stubs that report RDMA as unavailable.
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

NATIVE = Path("native")
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter"]


def has_verbs(include_dirs: Sequence[str] = ()) -> bool:
    """True when `#include <infiniband/verbs.h>` compiles with this interpreter's C compiler."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp, "probe.c")
        probe.write_text("#include <infiniband/verbs.h>\nint main(void) { return 0; }\n")
        cmd = [*cc, *(f"-I{d}" for d in include_dirs), "-fsyntax-only", str(probe)]
        try:
            return subprocess.run(cmd, capture_output=True, check=False).returncode == 0
        except OSError:
            return False


def transfer_engine_extension() -> object:
    """The mooncake_server.transfer._native extension, with RDMA when the headers exist."""
    from setuptools import Extension

    verbs = has_verbs()
    return Extension(
        "mooncake_server.transfer._native",
        sources=sorted(str(p) for p in NATIVE.glob("*.c")),
        depends=sorted(str(p) for p in NATIVE.glob("*.h")),
        include_dirs=[str(NATIVE)],
        define_macros=[("TE_HAVE_VERBS", "1")] if verbs else [],
        libraries=["crypto", "pthread"] + (["ibverbs"] if verbs else []),
        extra_compile_args=["-O2", "-std=gnu11", *WARNINGS, "-fvisibility=hidden"],
    )


def linear_extensions() -> list[object]:
    """The native linear kernels (x86-64 only; each used where the CPU has what it needs).

    OpenMP: the library resolves to the libgomp torch has loaded (same soname), so the kernels
    run on torch's thread team and size it as torch's own ops do.
    """
    from setuptools import Extension

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return [Extension(
        f"mooncake_server.engine._{name}",
        sources=[str(NATIVE / "linear" / f"{name}.c")],
        depends=sorted(str(h) for h in (NATIVE / "linear").glob("*.h")),
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", *WARNINGS, "-fvisibility=hidden",
                            # row_ops' rope gives torch's bits: a product and a sum, never fused
                            *(["-ffp-contract=off"] if name == "row_ops" else [])],
        extra_link_args=["-fopenmp"],
    ) for name in ("int8_vnni", "w8_group", "row_norm", "row_ops", "paged_decode")]


if __name__ == "__main__":
    from setuptools import setup

    setup(ext_modules=[transfer_engine_extension(), *linear_extensions()])
