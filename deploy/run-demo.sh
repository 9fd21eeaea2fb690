#!/usr/bin/env bash
# The README main command. Installs what is missing, builds Pith, starts a local cluster
# on loopback (1 coordinator, 2 expert stores), shows every process serving gRPC and
# Prometheus /metrics, and stops the cluster cleanly.
# NOTE: training the demo model on this cluster arrives with the worker and client
# issues; until then this runs the processes that exist.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
BUILD_DIR=${PITH_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" --target pith-coordinator pith-store

source deploy/proc-lib.sh
BIN=$BUILD_DIR/server
start_proc coordinator "$BIN/coordinator/pith-coordinator" --listen=127.0.0.1:0 --metrics_port=0
start_proc store0 "$BIN/store/pith-store" --listen=127.0.0.1:0 --metrics_port=0
start_proc store1 "$BIN/store/pith-store" --listen=127.0.0.1:0 --metrics_port=0

echo
echo "Pith local cluster:"
printf '  %-12s %-22s %s\n' process grpc metrics
for name in coordinator store0 store1; do
  wait_ready "$name"
  grpc=$(eval "echo \$GRPC_PORT_$name")
  metrics=$(eval "echo \$METRICS_PORT_$name")
  printf '  %-12s %-22s %s\n' "$name" "127.0.0.1:$grpc" "http://127.0.0.1:$metrics/metrics"
done

echo
echo "Scraped from each /metrics endpoint:"
for name in coordinator store0 store1; do
  metrics=$(eval "echo \$METRICS_PORT_$name")
  curl -sf "http://127.0.0.1:$metrics/metrics" | grep '^pith_build_info' | sed "s/^/  $name: /" ||
    fail "$name does not serve /metrics"
done

echo
for name in store1 store0 coordinator; do stop_proc "$name"; done
echo "Cluster stopped cleanly (SIGTERM, exit 0)."
