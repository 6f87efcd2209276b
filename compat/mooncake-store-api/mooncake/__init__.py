"""`mooncake` as mooncake-server provides it: only the store client API (`mooncake.store`,
`mooncake.mooncake_config`), backed by `mooncake_server.mooncake_api`."""

import importlib.metadata as _metadata

for _name in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
              "mooncake-transfer-engine-cuda13"):
    try:
        _metadata.distribution(_name)
    except _metadata.PackageNotFoundError:
        continue
    raise ImportError(f"both mooncake-store-api (mooncake-server) and {_name} are installed and "
                      "share the `mooncake` package; uninstall one of them")
