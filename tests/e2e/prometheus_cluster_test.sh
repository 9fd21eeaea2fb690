#!/usr/bin/env bash
# Prometheus on the files `pith up` writes: file service discovery finds every process of
# the local cluster, Pith's alert rules load, the coordinator's gauges follow a job (running,
# committing, cancelled), nothing alerts on a healthy cluster, and `pith down` empties the
# targets. The rules themselves are unit-tested by prometheus_rules_test (promtool).
set -euo pipefail
PITH=$1
source "$(dirname "$0")/../../deploy/proc-lib.sh"
export PITH_HOME=$E2E_TMP/home
trap '"$PITH" down >/dev/null 2>&1 || true; cleanup' EXIT

"$PITH" up --stores 1 --workers 2 >"$E2E_TMP/up.txt" || fail "pith up: $(cat "$E2E_TMP/up.txt")"
config=$PITH_HOME/prometheus/prometheus.yml
grep -qF "prometheus --config.file=$config" "$E2E_TMP/up.txt" || fail "pith up does not say how to scrape"
for f in prometheus.yml targets.json pith-rules.yml; do
  [[ -s $PITH_HOME/prometheus/$f ]] || fail "pith up wrote no prometheus/$f"
done
promtool check config "$config" >/dev/null || fail "promtool rejects $config"

start_prometheus "$config"
prom_wait 'count(up{job="pith"} == 1)' '"value":\[[0-9.]*,"4"\]'
for component in coordinator store worker; do
  prom_wait "pith_build_info{component=\"$component\"}" "\"member\":\"$component"
done
curl -sf "http://127.0.0.1:$PROM_PORT/api/v1/rules" | grep '"name":"PithJobStalled"' >/dev/null ||
  fail "the alert rules did not load"
prom_wait 'pith_coordinator_members{role="store",state="alive"}' '"value":\[[0-9.]*,"1"\]'
prom_wait 'pith_coordinator_members{role="worker",state="alive"}' '"value":\[[0-9.]*,"2"\]'

# A job that runs until cancelled: running, committing, then ended.
tiny_tokens "$PITH" 200
tiny_spec long 1000000 1 | sed 's/"store_replicas": 2/"store_replicas": 1/' >"$E2E_TMP/long.json"
job=$("$PITH" submit "$E2E_TMP/long.json") || fail "submit"
prom_wait "pith_coordinator_job_running{job=\"$job\"}" '"value":\[[0-9.]*,"1"\]' 300
prom_wait "pith_coordinator_job_committed_step{job=\"$job\"} > 2" '"value"' 300
"$PITH" cancel "$job" >/dev/null || fail "cancel"
prom_wait "pith_coordinator_job_running{job=\"$job\"}" '"value":\[[0-9.]*,"0"\]' 300
prom_wait 'pith_coordinator_jobs{state="cancelled"}' '"value":\[[0-9.]*,"1"\]'
# Every rule waits minutes before firing: on a healthy cluster none may even be pending
# (but the disk alert where this machine's disk really is over 90% full).
alerts=$(curl -sf "http://127.0.0.1:$PROM_PORT/api/v1/alerts") || fail "no alerts API"
names=$(grep -o '"alertname":"[A-Za-z]*"' <<<"$alerts" | cut -d'"' -f4 | sort -u || true)
used=$(df --output=pcent "$PITH_HOME" | tail -1 | tr -dc 0-9)
[[ $used -gt 90 ]] && names=$(grep -v '^PithStoreDiskNearlyFull$' <<<"$names" || true)
[[ -z $names ]] || fail "alerts on a healthy cluster: $alerts"

"$PITH" down >/dev/null || fail "pith down"
[[ ! -e $PITH_HOME/prometheus/targets.json ]] || fail "pith down left the targets"
echo "prometheus follows pith up's cluster: OK"
