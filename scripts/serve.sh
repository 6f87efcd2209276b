#!/usr/bin/env bash
# One command: set everything up, then start the all-in-one cluster on 127.0.0.1:${PORT:-8000}.
# Extra arguments go to mooncake-server (e.g. --kv-memory 2GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/mooncake-server --role all --port "${PORT:-8000}" "$@"
