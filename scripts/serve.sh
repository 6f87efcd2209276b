#!/usr/bin/env bash
# One command: set everything up (skipped when nothing it depends on changed, see
# scripts/setup.sh), then start the all-in-one cluster on 127.0.0.1:${PORT:-8000}.
# Extra arguments go to mooncake-server (e.g. --kv-memory 2GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
port="${PORT:-8000}"
cat >&2 <<NOTE
[serve] starting mooncake-server --role all on port $port. It is ready for requests once it logs
[serve] "ready: OpenAI API at http://...:$port/v1" (its roles take some seconds to start): by then
[serve] GET /health answers 200; before, it answers 503 "waiting for instances" (or nothing yet),
[serve] and a completion gets 503 although /v1/models already answers.
NOTE
exec .venv/bin/mooncake-server --role all --port "$port" "$@"
