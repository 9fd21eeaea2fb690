#!/usr/bin/env bash
# The server processes start on ephemeral ports, serve /metrics and gRPC, stop cleanly on
# SIGTERM, and reject bad flags and busy ports with one clear line and a non-zero exit.
set -euo pipefail
COORDINATOR=$1 STORE=$2 PITH=$3
source "$(dirname "$0")/../../deploy/proc-lib.sh"

make_tls "$PITH" coordinator coordinator blocker
make_tls "$PITH" member store busy
start_proc coordinator "$COORDINATOR" --listen=127.0.0.1:0 --metrics_port=0 \
  --data_dir="$E2E_TMP/coordinator-data" --tls_dir="$E2E_TMP/tls/coordinator"
start_proc store "$STORE" --listen=127.0.0.1:0 --metrics_port=0 --data_dir="$E2E_TMP/store-data" \
  --tls_dir="$E2E_TMP/tls/store"
wait_ready coordinator
wait_ready store

# await_line FILE PATTERN [TENTHS]: waits TENTHS tenths of a second (default 100) at most
# for a line matching PATTERN in FILE; false if none came.
await_line() {
  for _ in $(seq "${3:-100}"); do
    grep -q "$2" "$1" && return 0
    sleep 0.1
  done
  return 1
}

for name in coordinator store; do
  port=$(eval "echo \$METRICS_PORT_$name")
  body=$(curl -sf "http://127.0.0.1:$port/metrics") || fail "$name /metrics did not answer"
  grep -q "pith_build_info{component=\"$name\"" <<<"$body" || fail "$name: no pith_build_info"
  grep -q '^pith_process_start_time_seconds ' <<<"$body" || fail "$name: no start time"
  if [[ $name == store ]]; then
    for metric in 'pith_store_tier_bytes{tier="ram"}' 'pith_store_tier_bytes{tier="rocksdb"}' \
      'pith_store_gets_total{tier="ram"}' 'pith_store_puts_total' 'pith_store_get_seconds_count' \
      'pith_store_promotions_total' 'pith_store_demotions_total' 'pith_store_bytes_sent_total'; do
      grep -qF "$metric" <<<"$body" || fail "store: no $metric"
    done
  fi
  grpc=$(eval "echo \$GRPC_PORT_$name")
  (exec 3<>"/dev/tcp/127.0.0.1/$grpc") 2>/dev/null || fail "$name gRPC port $grpc is closed"
done

# Plaintext to a TLS port gets nothing: the CLI without a certificate cannot reach it.
rc=0
out=$(PITH_HOME=$E2E_TMP/nohome "$PITH" --coordinator "127.0.0.1:$GRPC_PORT_coordinator" status 2>&1) ||
  rc=$?
[[ $rc == 1 ]] && grep -q "cannot reach" <<<"$out" || fail "a plaintext call got in (exit $rc): $out"

# SIGHUP rotates certificates: a store's directory gets a new key and certificate (same
# name, same CA), SIGHUP checks them and puts them in use without a restart; files that do
# not make a certificate are refused in one line and the one in use stays. Neither stops a
# process.
served_serial() {  # the serial number of the certificate the store's gRPC port presents
  openssl s_client -connect "127.0.0.1:$GRPC_PORT_store" -cert "$E2E_TMP/tls/coordinator/cert.pem" \
    -key "$E2E_TMP/tls/coordinator/key.pem" -CAfile "$E2E_TMP/tls/ca.pem" </dev/null 2>/dev/null |
    openssl x509 -noout -serial 2>/dev/null
}
old=$(served_serial || true)
[[ $old == serial=* ]] || fail "no certificate on the store's port: ${old:-nothing}"
mv "$E2E_TMP/tls/store" "$E2E_TMP/tls/store.old"
make_tls "$PITH" member store
new=$(openssl x509 -noout -serial -in "$E2E_TMP/tls/store/cert.pem")
[[ $new != "$old" ]] || fail "pith certs issued the same serial"
kill -HUP "$PID_coordinator" "$PID_store"
for _ in $(seq 50); do
  [[ $(served_serial) == "$new" ]] && break
  sleep 0.1
done
[[ $(served_serial) == "$new" ]] || fail "the store still presents $old after SIGHUP, not $new"
grep -q "SIGHUP: .*/tls/store holds a valid certificate of store (member)" "$E2E_TMP/store.log" ||
  fail "store: no reload line: $(grep SIGHUP "$E2E_TMP/store.log")"
cp "$E2E_TMP/tls/store.old/key.pem" "$E2E_TMP/tls/store/key.pem"  # not this certificate's key
kill -HUP "$PID_store"
await_line "$E2E_TMP/store.log" "SIGHUP: .*key.pem is not the key of .*stays in use" 50 ||
  fail "store: a broken rotation was not refused: $(grep SIGHUP "$E2E_TMP/store.log")"
sleep 2.5  # past a file-watch round: the certificate in use is still the new one
[[ $(served_serial) == "$new" ]] || fail "a broken rotation replaced the certificate in use"
for name in coordinator store; do
  kill -0 "$(eval "echo \$PID_$name")" 2>/dev/null || fail "$name died of SIGHUP"
done

# A second store with the first one's identity waits for that one's lease to lapse (up to
# two minutes); SIGTERM ends the wait at once, saying so. (store.old: the first
# certificate of the name, left whole.)
start_proc first "$STORE" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/first-data" \
  --tls_dir="$E2E_TMP/tls/store.old" --coordinator="127.0.0.1:$GRPC_PORT_coordinator"
wait_ready first
mkdir -p "$E2E_TMP/twin-data"
cp "$E2E_TMP/first-data/pith-member-identity" "$E2E_TMP/twin-data/"
start_proc twin "$STORE" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/twin-data" \
  --tls_dir="$E2E_TMP/tls/store.old" --coordinator="127.0.0.1:$GRPC_PORT_coordinator"
await_line "$E2E_TMP/twin.log" "still registered by its previous process" ||
  fail "a store with a live store's identity did not wait: $(tail -3 "$E2E_TMP/twin.log")"
kill -TERM "$PID_twin"
for _ in $(seq 30); do
  kill -0 "$PID_twin" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$PID_twin" 2>/dev/null && fail "a store waiting to register outlived its SIGTERM by 3 s"
wait "$PID_twin" || fail "a store stopped while waiting to register exited $? (a stop asked for)"
grep -q "stopped by a signal while waiting to register" "$E2E_TMP/twin.log" ||
  fail "the stopped wait was not named: $(tail -3 "$E2E_TMP/twin.log")"

# A coordinator whose data was replaced is of another cluster: the store, whose data
# belongs to the first, does not join it (the new one would give out the old jobs' ids
# again, over the old blobs).
# A running store, whose coordinator is replaced by a new one at its address, says so and
# is not placed on: the new coordinator lists no store.
stop_proc coordinator
start_proc coordinator2 "$COORDINATOR" --listen="127.0.0.1:$GRPC_PORT_coordinator" --metrics_port=-1 \
  --data_dir="$E2E_TMP/coordinator2-data" --tls_dir="$E2E_TMP/tls/coordinator"
wait_ready coordinator2
await_line "$E2E_TMP/first.log" "first-data belongs to cluster" 150 ||
  fail "a running store joined a new cluster's coordinator: $(tail -3 "$E2E_TMP/first.log")"
make_tls "$PITH" admin ops
sleep 2  # past a few heartbeats: none registers it again
members=$("$PITH" --coordinator "127.0.0.1:$GRPC_PORT_coordinator2" --tls_dir "$E2E_TMP/tls/ops" \
  cluster 2>&1) || fail "pith cluster: $members"
grep -q "store-" <<<"$members" && fail "the new coordinator lists the other cluster's store: $members"
stop_proc first
if out=$(timeout 30 "$STORE" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/first-data" \
  --tls_dir="$E2E_TMP/tls/store.old" --coordinator="127.0.0.1:$GRPC_PORT_coordinator2" 2>&1); then
  fail "a store joined the coordinator of another cluster"
fi
grep -q "first-data belongs to cluster [0-9a-f]*, and this coordinator's is [0-9a-f]*" <<<"$out" ||
  fail "a store of another cluster was not refused by name: $out"
stop_proc coordinator2
stop_proc store

# Neither --tls_dir nor --insecure: one line naming both. --insecure off loopback: refused.
# A certificate of the wrong role: refused, naming it.
if out=$("$STORE" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/x" 2>&1); then
  fail "a store without --tls_dir or --insecure started"
fi
grep -q -- "--tls_dir.*--insecure" <<<"$out" || fail "no-security error unclear: $out"
if out=$("$STORE" --listen=0.0.0.0:0 --metrics_port=-1 --data_dir="$E2E_TMP/x" --insecure 2>&1); then
  fail "an insecure store listened on every interface"
fi
grep -q "loopback addresses only" <<<"$out" || fail "insecure off loopback unclear: $out"
if out=$("$STORE" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/x" \
  --tls_dir="$E2E_TMP/tls/coordinator" 2>&1); then
  fail "a store started with the coordinator's certificate"
fi
grep -q "needs one with the member role" <<<"$out" || fail "wrong-role error unclear: $out"

# A disk without the reserve: both refuse to start (RocksDB aborts recovering onto a full
# disk), in one line; a reserve under 4 MiB is refused as such. (A reserve larger than any
# disk stands for a full one.)
for bin in "$COORDINATOR" "$STORE"; do
  if out=$(timeout 30 "$bin" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/full" --insecure \
    --disk_reserve_bytes=1152921504606846976 2>&1); then
    fail "$bin started on a disk without its reserve"
  fi
  grep -q "the disk under $E2E_TMP/full.* is full: .* bytes free, less than the reserve" <<<"$out" ||
    fail "$bin: full-disk error unclear: $out"
  if out=$(timeout 30 "$bin" --listen=127.0.0.1:0 --metrics_port=-1 --data_dir="$E2E_TMP/full" --insecure \
    --disk_reserve_bytes=0 2>&1); then
    fail "$bin started with no disk reserve"
  fi
  grep -q -- "--disk_reserve_bytes=0 is under 4194304" <<<"$out" || fail "$bin: reserve 0 unclear: $out"
done

# --help describes the process and its flags.
help=$("$STORE" --help 2>&1) || fail "pith-store --help exited $? (asked for, help is no failure)"
grep -q "holds expert weights" <<<"$help" || fail "pith-store --help: $help"
grep -q -- "--metrics_port" <<<"$help" || fail "pith-store --help lists no flags: $help"

# An unknown flag: non-zero exit with a line naming it.
if out=$("$STORE" --no_such_flag=1 2>&1); then fail "unknown flag accepted"; fi
grep -q "no_such_flag" <<<"$out" || fail "unknown flag not named: $out"

# A busy metrics port: non-zero exit and one clear error line. The blocker takes a port the
# kernel gives it (a port picked beforehand could be taken by a parallel test first).
start_proc blocker "$COORDINATOR" --listen=127.0.0.1:0 --metrics_port=0 \
  --data_dir="$E2E_TMP/blocker-data" --tls_dir="$E2E_TMP/tls/blocker"
wait_ready blocker
busy=$METRICS_PORT_blocker
if out=$("$STORE" --listen=127.0.0.1:0 --metrics_port="$busy" --data_dir="$E2E_TMP/busy-data" \
  --tls_dir="$E2E_TMP/tls/busy" 2>&1); then
  fail "second process on a busy metrics port started"
fi
grep -q "cannot serve on 127.0.0.1:$busy" <<<"$out" || fail "busy port error unclear: $out"
stop_proc blocker

echo "process shells: OK"
