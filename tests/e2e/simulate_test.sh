#!/usr/bin/env bash
# pith-coordinator --simulate at DeepSeek-V3-like scale (58 MoE layers x 256 experts, top-8,
# 256 workers, 32 stores, Zipf 1.2) prints its one line and meets the placement targets:
# max/mean owner load <= 1.3, cross-worker sends <= 0.6x round robin, a store join moves
# <= 1.2/S of the blobs. replan_ms is checked (<= 50) only with PITH_STRICT_TIMING=1: CTest
# runs tests side by side on 2 cores, so wall time here is not the planner's own.
set -euo pipefail
COORDINATOR=$1
line=$("$COORDINATOR" --simulate)
echo "$line"
field() { grep -o "$1=[0-9.]*" <<<"$line" | cut -d= -f2; }
load=$(field max_over_mean_load)
sends=$(field cross_worker_sends_per_token)
rr=$(field rr_cross_worker_sends_per_token)
moved=$(field moved_blobs_on_store_join)
replan=$(field replan_ms)
awk -v x="$load" 'BEGIN {exit !(x <= 1.3)}' || { echo "FAIL: max_over_mean_load $load > 1.3"; exit 1; }
awk -v x="$sends" -v y="$rr" 'BEGIN {exit !(x <= 0.6 * y)}' || { echo "FAIL: sends $sends > 0.6 x $rr"; exit 1; }
awk -v x="$moved" 'BEGIN {exit !(x <= 1.2 / 32)}' || { echo "FAIL: moved $moved > 1.2/32"; exit 1; }
if [[ ${PITH_STRICT_TIMING:-0} == 1 ]]; then
  awk -v x="$replan" 'BEGIN {exit !(x <= 50)}' || { echo "FAIL: replan_ms $replan > 50"; exit 1; }
fi
echo "simulate: OK"
