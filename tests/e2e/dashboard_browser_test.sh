#!/usr/bin/env bash
# The coordinator's dashboard in a real headless Chromium: on a local cluster (`pith up`,
# TLS on) running a job, the page loads from the coordinator's HTTP port, shows the job
# with its step advancing between two loads, its loss curve, the members and the expert
# heat map, and the browser logs no console error. Skipped where Chromium is missing.
set -euo pipefail
PITH=$1
source "$(dirname "$0")/../../deploy/proc-lib.sh"
CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
if [[ -z $CHROMIUM ]]; then
  echo "SKIP: Chromium is not installed (Debian's chromium; deploy/install-deps.sh installs it)"
  exit 77
fi
export PITH_HOME=$E2E_TMP/home
trap '"$PITH" down >/dev/null 2>&1 || true; cleanup' EXIT
"$PITH" up --stores 2 --workers 2 >"$E2E_TMP/up.txt" || fail "pith up: $(cat "$E2E_TMP/up.txt")"
url=$(sed -n "s/^Dashboard: //p" "$E2E_TMP/up.txt")
[[ $url == http://127.0.0.1:*/ ]] || fail "pith up printed no coordinator HTTP address: $(cat "$E2E_TMP/up.txt")"

tiny_tokens "$PITH" 200
tiny_spec dash 1000000 2 >"$E2E_TMP/dash.json"
job=$("$PITH" submit "$E2E_TMP/dash.json") || fail "submit"
for _ in $(seq 300); do
  step=$("$PITH" status "$job" --output json | sed -n 's/.*"committed_step":"\([0-9]*\)".*/\1/p')
  [[ ${step:-0} -ge 3 ]] && break
  sleep 0.2
done
[[ ${step:-0} -ge 3 ]] || fail "job $job did not start training"

# One page load: Chromium runs the script until its virtual time budget is spent (the
# page polls every second), then prints the DOM; console messages go to its log.
load() {
  timeout 90 "$CHROMIUM" --headless --no-sandbox --disable-gpu --no-first-run \
    --user-data-dir="$E2E_TMP/chromium" --enable-logging=stderr --v=0 \
    --virtual-time-budget=4000 --dump-dom "$url" >"$E2E_TMP/$1.html" 2>"$E2E_TMP/$1.log" ||
    fail "chromium could not load $url: $(tail -5 "$E2E_TMP/$1.log")"
}
step_on_page() {
  sed -n "s/.*data-job=\"$job\" data-step=\"\([0-9]*\)\".*/\1/p" "$E2E_TMP/$1.html" | head -1
}
load first
sleep 2
load second
for page in first second; do
  html=$E2E_TMP/$page.html
  grep -q "data-job=\"$job\"" "$html" || fail "the $page load does not list job $job: $(head -c 2000 "$html")"
  updates=$(sed -n 's/.*<body data-updates="\([0-9]*\)".*/\1/p' "$html")
  [[ ${updates:-0} -ge 1 ]] || fail "the $page load never refreshed from the API: $(grep -o '<div id="errors">[^<]*' "$html")"
  grep -q '<div id="errors"></div>' "$html" || fail "the page shows an error: $(grep -o '<div id="errors">[^<]*' "$html")"
  grep -q 'id="curve-svg"[^>]*data-points="[1-9]' "$html" || fail "no loss curve on the $page load"
  grep -q 'id="heat-svg"[^>]*data-cells="8"' "$html" || fail "no heat map of 2 layers x 4 experts on the $page load"
  for member in store-0 store-1 worker-0 worker-1; do
    grep -q "data-member=\"$member\"" "$html" || fail "the $page load does not show $member"
  done
  if grep -E 'CONSOLE|Uncaught|Content Security Policy' "$E2E_TMP/$page.log" >"$E2E_TMP/console.txt"; then
    fail "console messages on the $page load: $(cat "$E2E_TMP/console.txt")"
  fi
done
first=$(step_on_page first) second=$(step_on_page second)
[[ -n $first && -n $second && $second -gt $first ]] ||
  fail "the job's step did not advance between two loads (${first:-none} then ${second:-none})"

# The JSON behind it: a bad or unknown job is a clear error, not a crash.
base=${url%/}
curl -s "$base/api/experts" | grep '"error": "the query needs job=ID"' >/dev/null || fail "no error for a missing job"
curl -s -o /dev/null -w '%{http_code}' "$base/api/experts?job=nope" | grep 404 >/dev/null || fail "no 404 for an unknown job"
curl -s -X POST -o /dev/null -w '%{http_code}' "$base/" | grep 405 >/dev/null || fail "a POST is not refused"
"$PITH" cancel "$job" >/dev/null || fail "cancel"
echo "dashboard in Chromium: job $job at step $first then $second, heat map and members shown: OK"
