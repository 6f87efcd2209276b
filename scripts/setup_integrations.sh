#!/usr/bin/env bash
# The environment SGLang's own Mooncake store backend runs in against our store
# (tests/store/test_sglang_mooncake.py), idempotently: .venv-sglang with CPU torch 2.13.0,
# sglang 0.5.23 without its GPU extras and the smallest set of modules its backend's import
# asks for, and mooncake-server's compat `mooncake.store` in .venv-sglang/compat.
# Its own venv because SGLang pins transformers 5.19 (ours: 5.24) and needs torchvision: the
# only PyPI torchvision that imports beside torch 2.13.0+cpu is 0.16.2 (its C++ ops fail to
# load and it marks them unavailable; SGLang reads only constants from it).
# Usage: scripts/setup_integrations.sh   (scripts/setup.sh --test runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${MOONCAKE_SGLANG_VENV:-.venv-sglang}"
say() { printf '[setup-integrations] %s\n' "$*" >&2; }
if [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$(sha256sum "$0" | cut -d' ' -f1)" ]; then
  say "up to date ($VENV)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
cons="$(mktemp)"
echo "torch==2.13.0" > "$cons"
say "installing sglang 0.5.23 (no GPU extras) into $VENV"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.16.2
"${PIP[@]}" -c "$cons" numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 \
  requests==2.34.2 packaging==26.4 pillow==13.0.0 starlette==1.10.0 triton==3.9.0 \
  msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 \
  aiohttp==3.14.5 transformers==5.19.0 apache-tvm-ffi==0.1.11 dill==0.4.1 \
  sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf==0.19.0
# What mooncake_server.mooncake_api imports (the package itself comes from the checkout).
"${PIP[@]}" -c "$cons" fastapi httpx prometheus-client aiofiles pyyaml uvicorn
rm -f "$cons"
rm -rf "$VENV/compat"
"$VENV/bin/python" -m pip install -q --no-deps --no-index --no-build-isolation \
  --target "$VENV/compat" ./compat/mooncake-store-api
sha256sum "$0" | cut -d' ' -f1 > "$VENV/.ready"
say "done"
