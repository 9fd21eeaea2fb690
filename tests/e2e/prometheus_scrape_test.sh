#!/usr/bin/env bash
# A real Prometheus server scrapes a Pith process and can query its metrics, including
# the gauges read at each scrape.
set -euo pipefail
STORE=$1 PITH=$2
source "$(dirname "$0")/../../deploy/proc-lib.sh"
make_tls "$PITH" member store

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

start_prometheus "$E2E_TMP/prometheus.yml"
prom_wait 'pith_build_info{component="store"}' '"component":"store"'
prom_wait 'up{job="pith"}' '"value":\[[0-9.]*,"1"\]'
# Read at each scrape: the data dir's file system, the durable tier's health.
prom_wait 'pith_store_disk_free_bytes > 0 and pith_store_disk_capacity_bytes > 0' '"value"'
prom_wait 'pith_store_healthy' '"value":\[[0-9.]*,"1"\]'
echo "prometheus scraped pith-store on port $METRICS_PORT_store: OK"
