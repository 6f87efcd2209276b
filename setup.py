"""Build the native transfer engine and the int8 linear kernel; metadata lives in pyproject.toml.

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


def int8_vnni_extension() -> object | None:
    """The int8 linear kernel for AVX512-VNNI (x86-64 only; used where the CPU has it).

    OpenMP: the library resolves to the libgomp torch has loaded (same soname), so the kernel
    runs on torch's thread team and sizes it as torch's own ops do.
    """
    from setuptools import Extension

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return Extension(
        "mooncake_server.engine._int8_vnni",
        sources=[str(NATIVE / "linear" / "int8_vnni.c")],
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", *WARNINGS, "-fvisibility=hidden"],
        extra_link_args=["-fopenmp"],
    )


if __name__ == "__main__":
    from setuptools import setup

    extensions = [transfer_engine_extension(), int8_vnni_extension()]
    setup(ext_modules=[e for e in extensions if e is not None])
