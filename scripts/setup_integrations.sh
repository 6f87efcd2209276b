#!/usr/bin/env bash
# The environments the engines' own Mooncake store clients run in against our store,
# idempotently, each with mooncake-server's compat `mooncake.store` in <venv>/compat:
# - .venv-sglang (tests/store/test_sglang_mooncake.py): CPU torch 2.13.0, sglang 0.5.23
#   without its GPU extras and the smallest set of modules its backend's import asks for.
#   Its own venv because SGLang pins transformers 5.19 (ours: 5.24) and needs torchvision: the
#   only PyPI torchvision that imports beside torch 2.13.0+cpu is 0.16.2 (its C++ ops fail to
#   load and it marks them unavailable; SGLang reads only constants from it).
# - .venv-lmcache (tests/store/test_lmcache_mooncake.py): CPU torch 2.13.0, lmcache 0.5.6
#   without its dependencies (they name cupy-cuda13x, cuda-python, nvtx, ...: CUDA wheels a CPU
#   box cannot use) and the smallest set of modules the import of its mooncakestore connector
#   and LocalCPUBackend asks for. Its own venv because lmcache caps numpy at 2.2.6 and
#   prometheus_client at 0.24.1, and wants numba.
# Each is stamped (<venv>/.ready) with the hash of the code that builds it, so that editing
# one's steps rebuilds that one only, not the other a test run may be using.
# Usage: scripts/setup_integrations.sh   (scripts/setup.sh --test runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SGLANG_VENV="${MOONCAKE_SGLANG_VENV:-.venv-sglang}"
LMCACHE_VENV="${MOONCAKE_LMCACHE_VENV:-.venv-lmcache}"
say() { printf '[setup-integrations] %s\n' "$*" >&2; }
cons="$(mktemp)"
trap 'rm -f "$cons"' EXIT
# Any resolver step that would swap in another torch (a CUDA build) fails instead.
echo "torch==2.13.0" > "$cons"

stamp() { { declare -f compat "$1"; cat "$cons"; } | sha256sum | cut -d' ' -f1; }
ready() { [ -f "$1/.ready" ] && [ "$(cat "$1/.ready")" = "$(stamp "$2")" ]; }

# --target, not site-packages: the tests put it first on PYTHONPATH and assert that the
# engine imported this file, never a real Mooncake wheel's.
compat() {
  rm -rf "$1/compat"
  "$1/bin/python" -m pip install -q --no-deps --no-index --no-build-isolation \
    --target "$1/compat" ./compat/mooncake-store-api
  stamp "$2" > "$1/.ready"
}

setup_sglang() {
  local VENV="$SGLANG_VENV"
  if ready "$VENV" "${FUNCNAME[0]}"; then say "up to date ($VENV)"; return 0; fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local PIP=("$VENV/bin/python" -m pip install -q)
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
  compat "$VENV" "${FUNCNAME[0]}"
}

setup_lmcache() {
  local VENV="$LMCACHE_VENV"
  if ready "$VENV" "${FUNCNAME[0]}"; then say "up to date ($VENV)"; return 0; fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local PIP=("$VENV/bin/python" -m pip install -q)
  say "installing lmcache 0.5.6 (no CUDA dependencies) into $VENV"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" --no-deps lmcache==0.5.6
  # numba for LMCache's CPU kernels (the device ops its CPU platform resolves to);
  # transformers for its cachegen serde module, imported by the storage backends package;
  # numpy 2.2.6 and prometheus-client 0.24.1 are lmcache's caps.
  "${PIP[@]}" -c "$cons" pyyaml==6.0.4 requests==2.34.2 cachetools==6.2.4 \
    sortedcontainers==2.4.0 numpy==2.2.6 numba==0.61.2 llvmlite==0.44.0 py-cpuinfo==9.0.0 \
    psutil==7.2.2 aiohttp==3.14.5 aiofile==3.12.3 msgspec==0.23.0 pyzmq==27.3.0 \
    transformers==5.19.0 cryptography==50.0.2 prometheus-client==0.24.1
  # What mooncake_server.mooncake_api imports (the package itself comes from the checkout).
  "${PIP[@]}" -c "$cons" fastapi==0.165.0 httpx==0.29.0 prometheus-client==0.24.1 \
    aiofiles==25.1.0 pyyaml==6.0.4 uvicorn==0.55.0
  compat "$VENV" "${FUNCNAME[0]}"
}

setup_sglang
setup_lmcache
say "done"
