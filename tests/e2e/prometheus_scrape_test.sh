#!/usr/bin/env bash
# A real Prometheus server scrapes a Pith process and can query its metrics.
set -euo pipefail
STORE=$1 PITH=$2
source "$(dirname "$0")/../../deploy/proc-lib.sh"
make_tls "$PITH" member store

PROMETHEUS=$(command -v prometheus || true)
[[ -x /usr/bin/prometheus ]] && PROMETHEUS=/usr/bin/prometheus
[[ -n $PROMETHEUS ]] || fail "prometheus is not installed (deploy/install-deps.sh installs it)"

start_proc store "$STORE" --listen=127.0.0.1:0 --metrics_port=0 --data_dir="$E2E_TMP/store-data" \
  --tls_dir="$E2E_TMP/tls/store"
wait_ready store

cat >"$E2E_TMP/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: pith
    static_configs:
      - targets: ['127.0.0.1:$METRICS_PORT_store']
YAML

for attempt in 1 2 3; do
  PROM_PORT=$(free_port)
  start_proc prometheus "$PROMETHEUS" --config.file="$E2E_TMP/prometheus.yml" \
    --storage.tsdb.path="$E2E_TMP/tsdb" --web.listen-address="127.0.0.1:$PROM_PORT"
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null 2>&1 && break 2
    kill -0 "$PID_prometheus" 2>/dev/null || break
    sleep 0.2
  done
  kill -9 "$PID_prometheus" 2>/dev/null || true
  [[ $attempt == 3 ]] && fail "prometheus did not start"
done

query='pith_build_info{component="store"}'
for _ in $(seq 150); do
  result=$(curl -sf -G "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$query" || true)
  if grep -q '"component":"store"' <<<"$result"; then
    up=$(curl -sf -G "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode 'query=up{job="pith"}')
    grep -q '"value":\[[0-9.]*,"1"\]' <<<"$up" || fail "target not up: $up"
    echo "prometheus scraped pith-store on port $METRICS_PORT_store: OK"
    exit 0
  fi
  sleep 0.2
done
fail "prometheus never returned $query; last answer: ${result:-none}"
