"""Build the native transfer engine; all package metadata lives in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("native")

transfer_engine = Extension(
    "mooncake_server.transfer._native",
    sources=sorted(str(p) for p in NATIVE.glob("*.c")),
    depends=sorted(str(p) for p in NATIVE.glob("*.h")),
    include_dirs=[str(NATIVE)],
    libraries=["crypto", "pthread"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-fvisibility=hidden"],
)

setup(ext_modules=[transfer_engine])
