#!/usr/bin/env bash
# Fetch bandwidth between hosts' network stacks: two network namespaces, each with a veth
# on one bridge (a switch between two hosts; UCX 1.13's TCP transport finds a bare veth
# pair between namespaces unreachable), UCX over TCP only: no shared memory, no CMA.
# store_fetch_bench runs in one, the store and ucx_perftest's server in the other, so the
# fetch and its anchor (ucx_perftest ucp_am_bw, same sizes, same path) are measured in the
# same run. Needs root.
# Usage: tests/bench/netns_fetch_bench.sh BUILD_DIR [--seconds=S] [--size=BYTES]
set -euo pipefail
BUILD=$(cd "${1:?usage: netns_fetch_bench.sh BUILD_DIR [bench flags]}" && pwd)
shift
[[ $(id -u) == 0 ]] || { echo "netns_fetch_bench: needs root (ip netns)" >&2; exit 1; }
BR=pfbr$$ NET=10.214.$(($$ % 200))
teardown() {
  for i in 1 2; do ip netns del "pf$$-$i" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
}
trap teardown EXIT
ip link add "$BR" type bridge
ip link set "$BR" up
for i in 1 2; do
  ns=pf$$-$i
  ip netns add "$ns"
  ip link add "pfo$$-$i" type veth peer name "pfi$$-$i"
  ip link set "pfi$$-$i" netns "$ns"
  ip link set "pfo$$-$i" master "$BR" up
  ip -n "$ns" addr add "$NET.$i/24" dev "pfi$$-$i"
  ip -n "$ns" link set "pfi$$-$i" up
  ip -n "$ns" link set lo up
done
echo "client $NET.1 -> store $NET.2 over veths on a bridge, UCX over TCP"
ip netns exec "pf$$-1" env UCX_TLS=tcp,self "$BUILD/tests/bench/store_fetch_bench" --tier=ram \
  --peer_netns="pf$$-2" --peer_host="$NET.2" "$@"
