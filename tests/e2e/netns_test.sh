#!/usr/bin/env bash
# Pith across hosts, as far as one machine can show it: the coordinator, 2 stores and 2
# workers each in its own network namespace (own address on a bridge, UCX over TCP only:
# no shared memory, no CMA). A job trains to the same held-out loss as on a loopback
# cluster; a second job (R = 2) loses one store's link mid-job and still finishes; then
# every process stops on SIGTERM with exit 0. Skipped (exit 77) where namespaces cannot
# be made (they need root).
set -euo pipefail
PITH=$1 COORDINATOR=$2 STORE=$3 WORKER=$4
source "$(dirname "$0")/../../deploy/proc-lib.sh"

if [[ $(id -u) != 0 ]] || ! ip netns add "pith-probe-$$" 2>/dev/null; then
  echo "SKIP: network namespaces cannot be made here (needs root and iproute2)"
  exit 77
fi
ip netns del "pith-probe-$$"

BR=pbr$$ NET=10.213.$(($$ % 200)) NAMES=()
teardown() {
  "$PITH" down >/dev/null 2>&1 || true
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for n in "${NAMES[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
  cleanup
}
trap teardown EXIT
ip link add "$BR" type bridge
ip addr add "$NET.254/24" dev "$BR"
ip link set "$BR" up

host() {  # INDEX: a namespace pn<pid>-INDEX at $NET.INDEX, linked to the bridge
  local ns=pn$$-$1 outside=pv$$-$1 inside=pe$$-$1
  ip netns add "$ns"
  NAMES+=("$ns")
  ip link add "$outside" type veth peer name "$inside"
  ip link set "$inside" netns "$ns"
  ip link set "$outside" master "$BR" up
  ip netns exec "$ns" ip addr add "$NET.$1/24" dev "$inside"
  ip netns exec "$ns" ip link set "$inside" up
  ip netns exec "$ns" ip link set lo up
}
in_host() {  # INDEX CMD...: CMD in that namespace, UCX over TCP only
  local ns=pn$$-$1
  shift
  exec ip netns exec "$ns" env UCX_TLS=tcp,self "$@"
}
for i in 1 2 3 4 5; do host "$i"; done

tiny_tokens "$PITH" 400
tiny_spec same 15 2 >"$E2E_TMP/same.json"
tiny_spec cut 60 2 >"$E2E_TMP/cut.json"
held_out() {  # CHECKPOINT: the held-out cross-entropy line
  "$PITH" eval --checkpoint "$1" --tokens "$E2E_TMP/tokens.bin" --batches 2 | grep -o 'ce=[0-9.]*'
}

# The reference: the same job on a loopback cluster.
export PITH_HOME=$E2E_TMP/home
"$PITH" up --stores 2 --workers 2 >/dev/null || fail "pith up"
job=$("$PITH" submit "$E2E_TMP/same.json")
"$PITH" watch "$job" >/dev/null || fail "the loopback job failed"
"$PITH" checkpoint "$job" --out "$E2E_TMP/loopback.safetensors" >/dev/null
"$PITH" down >/dev/null
want=$(held_out "$E2E_TMP/loopback.safetensors")

C="$NET.1:7000"
# Mutual TLS as between hosts: each certificate names the addresses its process serves on.
make_tls "$PITH" coordinator coordinator -- "$NET.1"
make_tls "$PITH" member store0 store1 worker0 worker1 -- "$NET.2" "$NET.3" "$NET.4" "$NET.5"
make_tls "$PITH" admin admin
start_proc coordinator in_host 1 "$COORDINATOR" --listen="$C" --metrics_port=-1 \
  --data_dir="$E2E_TMP/c" --lease_ms=1500 --tls_dir="$E2E_TMP/tls/coordinator"
wait_ready coordinator
for s in 0 1; do
  start_proc "store$s" in_host $((2 + s)) "$STORE" --listen="$NET.$((2 + s)):7100" \
    --metrics_port=0 --data_dir="$E2E_TMP/s$s" --ram_bytes=$((64 << 20)) --coordinator="$C" \
    --tls_dir="$E2E_TMP/tls/store$s"
  wait_ready "store$s"
done
# Both workers on host 4 and 5: every fetch, put and dispatch crosses a veth over TCP.
for w in 0 1; do
  start_proc "worker$w" in_host $((4 + w)) "$WORKER" --coordinator="$C" \
    --listen="$NET.$((4 + w)):0" --threads=1 --tls_dir="$E2E_TMP/tls/worker$w"
done
ip netns exec "pn$$-2" ss -ltn | grep "$NET.2:$METRICS_PORT_store0" >/dev/null ||
  fail "store0's metrics are not bound to its --listen address alone"

P=("$PITH" --coordinator "$C" --tls_dir "$E2E_TMP/tls/admin")
job=$("${P[@]}" submit "$E2E_TMP/same.json")
timeout 120 "${P[@]}" watch "$job" >/dev/null || fail "the job across namespaces failed"
"${P[@]}" checkpoint "$job" --out "$E2E_TMP/netns.safetensors" >/dev/null
got=$(held_out "$E2E_TMP/netns.safetensors")
[[ $got == "$want" ]] || fail "held-out loss across namespaces $got, on loopback $want"
echo "  ok: across namespaces over TCP the job ends at held-out $got, as on loopback"

# A store's link is cut mid-job: reads move to its replica, the job finishes.
job=$("${P[@]}" submit "$E2E_TMP/cut.json")
for _ in $(seq 600); do
  "${P[@]}" status "$job" | grep "step [1-9][0-9]*/60" >/dev/null && break
  sleep 0.1
done
ip link set "pv$$-2" down
start=$SECONDS
timeout 180 "${P[@]}" watch "$job" >"$E2E_TMP/cut.txt" ||
  fail "the job did not survive the cut: $(tail -2 "$E2E_TMP/cut.txt")"
grep -q "succeeded at step 60" "$E2E_TMP/cut.txt" || fail "cut job: $(tail -2 "$E2E_TMP/cut.txt")"
echo "  ok: store0's link cut mid-job, the job finished $((SECONDS - start)) s later"

# Every process, the cut-off store too, stops on SIGTERM with exit 0.
for name in worker0 worker1 store1 store0 coordinator; do stop_proc "$name"; done
echo "  ok: every process stopped on SIGTERM with exit 0"
