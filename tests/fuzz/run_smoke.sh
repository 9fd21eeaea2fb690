#!/usr/bin/env bash
# Short libFuzzer run: FUZZER SEED_CORPUS WORK_DIR SECONDS. New inputs go to WORK_DIR,
# never into the committed seed corpus. Any crash, leak or sanitizer report fails it.
set -euo pipefail
fuzzer=$(realpath "$1") seeds=$(realpath "$2") work=$3 seconds=$4
mkdir -p "$work"
cd "$work"
exec "$fuzzer" -max_total_time="$seconds" -seed=1 -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 "$work" "$seeds"
