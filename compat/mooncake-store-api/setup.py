"""Refuse to install beside Mooncake's own wheels: both provide the `mooncake` package, and
whichever came last would overwrite the other's files."""

import os
import subprocess
import sys

from setuptools import setup

REAL = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine-cuda13")
# NOTE: pip builds in an isolated environment; a child of the target interpreter without that
# isolation's settings sees what the target environment has installed.
_PROBE = ("import importlib.metadata as m, sys\n"
          "for name in sys.argv[1:]:\n"
          "    try:\n        m.distribution(name)\n    except m.PackageNotFoundError:\n"
          "        continue\n    print(name)\n")
env = {k: v for k, v in os.environ.items()
       if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONNOUSERBASE")}
found = subprocess.run([sys.executable, "-I", "-c", _PROBE, *REAL], capture_output=True,
                       text=True, env=env, check=False).stdout.split()
if found:
    sys.exit(f"mooncake-store-api: refusing to install beside {', '.join(found)}: both provide "
             "the `mooncake` package. Uninstall it first, or use a separate environment "
             "(or import mooncake_server.mooncake_api directly).")
setup()
