#!/usr/bin/env bash
# The README main command. Installs what is missing, builds Pith, starts a local cluster
# on loopback (1 coordinator, 2 expert stores) and shows every process serving gRPC and
# Prometheus /metrics, trains the demo model (deploy/demo/spec.json, DESIGN §3) on text
# from this repository, and stops the cluster cleanly.
# NOTE: until the worker and client issues join them up, the demo model trains in one
# `pith-worker --standalone` process beside the cluster rather than through it.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
BUILD_DIR=${PITH_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" --target pith-coordinator pith-store pith-worker pith

source deploy/proc-lib.sh
BIN=$BUILD_DIR/server
start_proc coordinator "$BIN/coordinator/pith-coordinator" --listen=127.0.0.1:0 --metrics_port=0 --data_dir="$E2E_TMP/coordinator"
start_proc store0 "$BIN/store/pith-store" --listen=127.0.0.1:0 --metrics_port=0 --data_dir="$E2E_TMP/store0" --ram_bytes=268435456
start_proc store1 "$BIN/store/pith-store" --listen=127.0.0.1:0 --metrics_port=0 --data_dir="$E2E_TMP/store1" --ram_bytes=268435456

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
echo "Training the demo model (d 128, 4 layers, 16 experts, top-2; 300 steps):"
cp deploy/demo/spec.json "$E2E_TMP/spec.json"
mapfile -t texts < <(git ls-files '*.md' '*.cc' '*.h' '*.proto' 2>/dev/null || find . -name '*.md')
"$BUILD_DIR/client/pith" data prepare --out "$E2E_TMP/tokens.bin" "${texts[@]}"
(cd "$E2E_TMP" && "$OLDPWD/$BUILD_DIR/worker/pith-worker" --standalone --spec=spec.json \
  --loss_log=loss.txt --save=demo.safetensors 2>&1 | grep -E 'step (1|[0-9]*00)/|trained') ||
  fail "training failed"
first=$(head -10 "$E2E_TMP/loss.txt" | awk '{s += $3} END {printf "%.3f", s / NR}')
last=$(tail -10 "$E2E_TMP/loss.txt" | awk '{s += $3} END {printf "%.3f", s / NR}')
echo "Mean cross-entropy over the first 10 steps: $first; over the last 10: $last (nats/byte)."
"$BUILD_DIR/client/pith" safetensors inspect "$E2E_TMP/demo.safetensors" | tail -1 |
  sed 's/^/Final weights: /'

echo
for name in store1 store0 coordinator; do stop_proc "$name"; done
echo "Cluster stopped cleanly (SIGTERM, exit 0)."
