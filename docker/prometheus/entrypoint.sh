#!/bin/sh
# Prometheus reads scrape credentials from a file only: write the cluster secret (from the
# environment, never baked into the image) where deploy/prometheus/prometheus.yml looks for it.
set -eu
umask 077
mkdir -p /run/mooncake
printf '%s' "${MOONCAKE_CLUSTER_SECRET:?set MOONCAKE_CLUSTER_SECRET}" > /run/mooncake/cluster-secret
exec prometheus --config.file=/etc/prometheus/mooncake.yml --storage.tsdb.path=/prometheus \
  --web.listen-address=0.0.0.0:9090 "$@"
