#!/usr/bin/env bash
# One command: set everything up (incl. test tools), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
