#!/usr/bin/env bash
# `pith up` on a cluster it recorded: members killed with -9 come back from the record
# while a job trains (and the job finishes), a job with one store copy of its data waits
# for stores stalled past their leases and finishes, the coordinator alone (its members find it in
# seconds), all of them after the whole cluster is killed (as by a reboot), each time at
# the coordinator's old address and their old metrics ports; other flags than the
# record's are refused; `pith down` never signals a process that took a member's pid; a
# later `pith up` in the same folder listens where the last coordinator did; workers end
# within seconds of SIGTERM with the coordinator frozen or dead; a store drained and
# stopped is not started again.
set -euo pipefail
PITH=$1
source "$(dirname "$0")/../../deploy/proc-lib.sh"
export PITH_HOME=$E2E_TMP/home
on_exit='"$PITH" down >/dev/null 2>&1 || true; cleanup'
trap "$on_exit" EXIT

pid_of() { awk -v n="$1" '$1 == n {print $2}' "$PITH_HOME/pids"; }
metrics_of() { awk -v n="$1" '$1 == n {print $5}' "$PITH_HOME/pids"; }
kill_and_wait() {  # PID...: kill -9, then wait (5 s at most) until each is gone
  kill -9 "$@"
  for pid in "$@"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
}
expect_fail() {  # WANT CMD...: exit 1, stderr containing WANT
  local want=$1 rc=0
  shift
  "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
  [[ $rc == 1 ]] || fail "$* exited $rc, want 1: $(cat "$E2E_TMP/err")"
  grep -q -- "$want" "$E2E_TMP/err" || fail "$* error lacks '$want': $(cat "$E2E_TMP/err")"
  echo "  ok: $(cat "$E2E_TMP/err")"
}
wait_alive() {  # KIND N SECONDS: until `pith cluster` shows N KIND-s alive
  for _ in $(seq $((2 * $3))); do
    (($("$PITH" cluster 2>/dev/null | grep -c "$1-.*alive") == $2)) && return 0
    sleep 0.5
  done
  fail "not $2 ${1}s alive within $3 s: $("$PITH" cluster 2>&1)"
}

"$PITH" up --stores 2 --workers 2 --cache_bytes 4096 >/dev/null || fail "pith up"
address=$(cat "$PITH_HOME/coordinator.address")
# up again with nothing dead: says so and starts nothing; asked for other flags, refuses.
"$PITH" up >"$E2E_TMP/again.txt" 2>&1 || fail "a second up: $(cat "$E2E_TMP/again.txt")"
grep -q "already up: every process runs, nothing to start" "$E2E_TMP/again.txt" ||
  fail "the second up said: $(cat "$E2E_TMP/again.txt")"
[[ $(cat "$PITH_HOME/coordinator.address") == "$address" ]] || fail "the second up moved it"
expect_fail "already up with --stores 2" "$PITH" up --stores 3

tiny_tokens "$PITH" 300
# One store copy: store1's restart must keep what it held (prepared steps, DESIGN §6).
tiny_spec restart 150 1 | sed 's/"store_replicas": 2/"store_replicas": 1/' >"$E2E_TMP/spec.json"
job=$("$PITH" submit "$E2E_TMP/spec.json")
for _ in $(seq 200); do
  "$PITH" status "$job" | grep -q "running.*step [1-9]" && break
  sleep 0.1
done
"$PITH" status "$job" | grep -q running || fail "$job is not running: $("$PITH" status "$job")"
store1_metrics=$(metrics_of store1)
kill_and_wait "$(pid_of worker1)" "$(pid_of store1)"
"$PITH" up >"$E2E_TMP/up.txt" || fail "pith up after kill -9: $(cat "$E2E_TMP/up.txt")"
grep -q "restarted store1, worker1 (coordinator, store0, worker0 kept running)" "$E2E_TMP/up.txt" ||
  fail "the restart said: $(head -1 "$E2E_TMP/up.txt")"
[[ $(cat "$PITH_HOME/coordinator.address") == "$address" ]] || fail "the coordinator moved"
[[ $(metrics_of store1) == "$store1_metrics" ]] || fail "store1's metrics moved from $store1_metrics"
timeout 120 "$PITH" watch "$job" >"$E2E_TMP/watch.txt" 2>&1 ||
  fail "the job across the restart: $(tail -3 "$E2E_TMP/watch.txt")"
grep -q "succeeded at step 150" "$E2E_TMP/watch.txt" || fail "watch: $(tail -2 "$E2E_TMP/watch.txt")"
echo "  ok: store1 and worker1 came back; $job finished"

# Stores that stall past their leases and the coordinator's 5-s deadline on store calls
# (SIGSTOP for 10 s: a stuck disk, a starved machine) while they hold the only copy of a
# job's data: the job waits for them rather than fail, and goes on once they answer again.
tiny_spec stall 300 1 | sed 's/"store_replicas": 2/"store_replicas": 1/' >"$E2E_TMP/stall.json"
grep -q '"store_replicas": 1' "$E2E_TMP/stall.json" ||
  fail "the stall job's spec: $(cat "$E2E_TMP/stall.json")"
job=$("$PITH" submit "$E2E_TMP/stall.json")
mid_job="running.*step ([3-9]|[1-9][0-9]|1[0-9][0-9])/300"  # steps 3 to 199 of 300
for _ in $(seq 200); do
  "$PITH" status "$job" | grep -Eq "$mid_job" && break
  sleep 0.1
done
"$PITH" status "$job" | grep -Eq "$mid_job" ||
  fail "$job is not running at a step from 3 to 199: $("$PITH" status "$job")"
stores=("$(pid_of store0)" "$(pid_of store1)")
trap 'kill -CONT "${stores[@]}" 2>/dev/null || true; '"$on_exit" EXIT  # never left stopped
waits() { grep -c "waits for store\|commit of step" "$PITH_HOME/coordinator.log" || true; }
before=$(waits)
awaited=$(grep -c "waits for store" "$PITH_HOME/coordinator.log" || true)
kill -STOP "${stores[@]}"
for _ in $(seq 20); do  # 10 s, asking `pith status` what the job does meanwhile
  "$PITH" status "$job" >>"$E2E_TMP/stall-status.txt" 2>&1 || true
  sleep 0.5
done
kill -CONT "${stores[@]}"
trap "$on_exit" EXIT
if (($(grep -c "waits for store" "$PITH_HOME/coordinator.log" || true) > awaited)); then
  grep -q "waiting up to 30s for store store-.*, which died holding data no live store has" \
    "$E2E_TMP/stall-status.txt" ||
    fail "pith status did not say the job waits for a store: $(tail -2 "$E2E_TMP/stall-status.txt")"
fi
timeout 120 "$PITH" watch "$job" >"$E2E_TMP/watch.txt" 2>&1 ||
  fail "the job across the stall: $(tail -3 "$E2E_TMP/watch.txt")"
grep -q "succeeded at step 300" "$E2E_TMP/watch.txt" || fail "watch: $(tail -2 "$E2E_TMP/watch.txt")"
# The wait shows in the coordinator's log, unless the stall came with a commit in flight
# (then the commit was held back, which logs each failed call instead).
(($(waits) > before)) || fail "the coordinator logged no wait for the stalled stores"
echo "  ok: $job (one store copy) finished across a 10-s stall of its stores"

# The coordinator alone: it comes back where the stores and workers look for it, and they
# find it within a few seconds, however long it was gone (20 s here).
dashboard=$(metrics_of coordinator)
kill_and_wait "$(pid_of coordinator)"
sleep 20
"$PITH" up >"$E2E_TMP/up.txt" || fail "pith up after the coordinator's kill: $(cat "$E2E_TMP/up.txt")"
grep -q "restarted coordinator (store0, store1, worker0, worker1 kept running)" "$E2E_TMP/up.txt" ||
  fail "the restart said: $(head -1 "$E2E_TMP/up.txt")"
[[ $(metrics_of coordinator) == "$dashboard" ]] || fail "the dashboard moved from port $dashboard"
start=$(date +%s)
wait_alive store 2 15
wait_alive worker 2 15
"$PITH" status "$job" | grep -q succeeded || fail "the coordinator lost $job: $("$PITH" status "$job")"
echo "  ok: the coordinator came back at $address; its stores and workers found it in $(($(date +%s) - start)) s"

# The whole cluster at once, as a reboot does: everything comes back at the same address,
# with the recorded flags.
kill_and_wait $(awk '{print $2}' "$PITH_HOME/pids")
expect_fail "was started with --stores 2" "$PITH" up --stores 3
"$PITH" up --stores 2 >"$E2E_TMP/up.txt" || fail "pith up after losing all: $(cat "$E2E_TMP/up.txt")"
grep -q "restarted coordinator, store0, store1, worker0, worker1:" "$E2E_TMP/up.txt" ||
  fail "the restart said: $(head -1 "$E2E_TMP/up.txt")"
[[ $(cat "$PITH_HOME/coordinator.address") == "$address" ]] || fail "the coordinator moved"
"$PITH" status "$job" | grep -q succeeded || fail "the coordinator lost $job: $("$PITH" status "$job")"
wait_alive store 2 60
[[ -s $PITH_HOME/coordinator.log.prev ]] || fail "the killed coordinator's log was not kept"
echo "  ok: the whole cluster came back at $address with its jobs"

"$PITH" down >/dev/null || fail "pith down"
# A record whose pid now belongs to another process: pith down leaves that process be.
sleep 300 >/dev/null 2>&1 &
other=$!
PIDS+=("$other")
echo "coordinator $other 1 $((${address##*:})) 1" >"$PITH_HOME/pids"
"$PITH" down >"$E2E_TMP/down.txt" || fail "pith down of a stale record"
grep -q "coordinator was not running" "$E2E_TMP/down.txt" || fail "down said: $(cat "$E2E_TMP/down.txt")"
kill -0 "$other" || fail "pith down signalled a process that was not the cluster's"
kill "$other"
echo "  ok: a reused pid is not signalled"

# After pith down, a plain pith up starts the cluster as it was (its flags kept), and a
# job running at the down goes on, even one with a single copy of its data.
"$PITH" up >"$E2E_TMP/up.txt" || fail "pith up after down"
grep -q -- "(with --cache_bytes 4096)" "$E2E_TMP/up.txt" ||
  fail "pith up after down said: $(head -3 "$E2E_TMP/up.txt")"
tiny_spec single 100000 1 | sed 's/"store_replicas": 2/"store_replicas": 1/' >"$E2E_TMP/single.json"
job=$("$PITH" submit "$E2E_TMP/single.json")
step_of() {  # JOB: its committed step (0 while the coordinator does not answer)
  local n
  n=$("$PITH" status "$1" 2>/dev/null | sed -n 's|.* step \([0-9]*\)/.*|\1|p') || true
  echo "${n:-0}"
}
for _ in $(seq 200); do
  (($(step_of "$job") >= 5)) && break
  sleep 0.1
done
"$PITH" watch "$job" >"$E2E_TMP/watch-single.txt" 2>&1 &  # it outlives the coordinator's absence
watcher=$!
PIDS+=("$watcher")
# The watch must have heard the job before the coordinator goes: one that heard nothing
# yet gives up after four tries (the job or the coordinator may not exist at all).
for _ in $(seq 100); do [[ -s $E2E_TMP/watch-single.txt ]] && break; sleep 0.1; done
[[ -s $E2E_TMP/watch-single.txt ]] || fail "pith watch printed nothing within 10 s"
"$PITH" down >/dev/null || fail "pith down with $job running"
# The coordinator judged no member while it stopped (the watch's stream kept its gRPC
# server up to 5 s without heartbeats: every store's lease lapsed, and the job used to be
# aborted for "dead" stores, that judgment kept across the restart).
judged=$(sed -n '/stopping on signal/,$p' "$PITH_HOME/coordinator.log" | grep -E "aborted|waits for" || true)
[[ -z $judged ]] || fail "the stopping coordinator judged members: $judged"
"$PITH" up >/dev/null || fail "pith up after down with $job running"
for _ in $(seq 120); do
  (($(step_of "$job") >= 20)) && break
  sleep 0.5
done
"$PITH" status "$job" | grep -q running || fail "$job after down and up: $("$PITH" status "$job")"
(($(step_of "$job") >= 20)) || fail "$job did not go on after down and up: $("$PITH" status "$job")"
echo "  ok: after down and up, $job (one store copy) went on: $("$PITH" status "$job")"
"$PITH" cancel "$job" >/dev/null || fail "pith cancel $job"
wait "$watcher" || true
grep -q "cancelled" "$E2E_TMP/watch-single.txt" ||
  fail "pith watch across down and up: $(tail -2 "$E2E_TMP/watch-single.txt")"
echo "  ok: a pith watch across down and up saw $job to its end"
"$PITH" down >/dev/null || fail "pith down"

# Relative folders name the same cluster from anywhere.
cd "$E2E_TMP" && "$PITH" up --dir home --stores 1 --workers 2 >/dev/null || fail "pith up after down"
cd / && { "$PITH" up --dir "$PITH_HOME/" >"$E2E_TMP/up.txt" 2>&1 ||
  fail "a second up in the same folder: $(cat "$E2E_TMP/up.txt")"; }
grep -q "already up" "$E2E_TMP/up.txt" || fail "the second up said: $(cat "$E2E_TMP/up.txt")"
[[ $(cat "$PITH_HOME/coordinator.address") == "$address" ]] ||
  fail "a new cluster in the folder listens at $(cat "$PITH_HOME/coordinator.address"), not $address"
# With the coordinator frozen mid-job (its calls hang instead of failing), each worker
# still ends within seconds of its SIGTERM: it cancels its calls and its waits on peers.
job=$("$PITH" submit "$E2E_TMP/spec.json")
for _ in $(seq 200); do
  "$PITH" status "$job" | grep -q "running.*step [1-9]" && break
  sleep 0.1
done
coordinator=$(pid_of coordinator)
workers=("$(pid_of worker0)" "$(pid_of worker1)")
kill -STOP "$coordinator"
sleep 1
kill -TERM "${workers[@]}"
start=$SECONDS
for pid in "${workers[@]}"; do
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
done
kill -CONT "$coordinator"
for pid in "${workers[@]}"; do
  kill -0 "$pid" 2>/dev/null && fail "a worker outlived its SIGTERM by 15 s with the coordinator frozen"
done
echo "  ok: with the coordinator frozen, both workers ended $((SECONDS - start)) s after SIGTERM"
# Woken, the coordinator does not hold its own pause against the store (the job's only
# copy of its data): the job waits for workers instead of failing.
sleep 2
"$PITH" status "$job" | grep -q "failed" && fail "the coordinator woke and failed $job: $("$PITH" status "$job")"
echo "  ok: the woken coordinator kept $job: $("$PITH" status "$job")"
"$PITH" cancel "$job" >/dev/null || fail "pith cancel $job"
"$PITH" up >/dev/null || fail "pith up after the workers' SIGTERM"
wait_alive worker 2 30

# With the coordinator dead mid-job, pith down still stops every member at its SIGTERM.
job=$("$PITH" submit "$E2E_TMP/spec.json")
for _ in $(seq 200); do
  "$PITH" status "$job" | grep -q "running.*step [1-9]" && break
  sleep 0.1
done
kill_and_wait "$(pid_of coordinator)"
sleep 2
"$PITH" down >"$E2E_TMP/down.txt" 2>&1 || fail "pith down without a coordinator: $(cat "$E2E_TMP/down.txt")"
grep -q killed "$E2E_TMP/down.txt" && fail "pith down had to kill: $(cat "$E2E_TMP/down.txt")"
echo "  ok: without a coordinator, every member stopped at SIGTERM"

# A worker that cannot join (its certificate is from another CA) never says it is ready:
# pith up fails, names it, and leaves nothing running or recorded.
other=$E2E_TMP/other-home
"$PITH" certs --dir "$E2E_TMP/other-ca" --name worker0 --role member >/dev/null || fail "pith certs"
mkdir -p "$other/tls" && cp -r "$E2E_TMP/other-ca/worker0" "$other/tls/worker0"
rc=0
"$PITH" up --dir "$other" --stores 1 --workers 1 >"$E2E_TMP/up.txt" 2>&1 || rc=$?
[[ $rc == 1 ]] || fail "pith up with a worker that cannot join exited $rc: $(cat "$E2E_TMP/up.txt")"
grep -q "worker0 exited at start" "$E2E_TMP/up.txt" || fail "pith up said: $(cat "$E2E_TMP/up.txt")"
[[ ! -e $other/pids ]] || fail "a failed pith up recorded its cluster"
for _ in $(seq 20); do pgrep -f -- "$other/" >/dev/null || break; sleep 0.1; done
pgrep -f -- "$other/" >/dev/null && fail "a failed pith up left processes running"
echo "  ok: $(cat "$E2E_TMP/up.txt")"
# An interrupted pith up (^C, a timeout) takes down what it started: nothing is left
# running that no record names.
partial=$E2E_TMP/partial-home
"$PITH" up --dir "$partial" --stores 40 --workers 20 --ram_bytes 1048576 >"$E2E_TMP/up.txt" 2>&1 &
up=$!
for _ in $(seq 100); do [[ -e $partial/store1.log ]] && break; sleep 0.05; done
kill -TERM "$up"  # as a timeout stops it (a background job ignores SIGINT)
rc=0
wait "$up" || rc=$?
if [[ -e $partial/pids ]]; then  # it was up before the signal: nothing to check
  "$PITH" down --dir "$partial" >/dev/null
else
  [[ $rc == 143 ]] || fail "the interrupted pith up exited $rc: $(cat "$E2E_TMP/up.txt")"
  for _ in $(seq 20); do pgrep -f -- "$partial/" >/dev/null || break; sleep 0.1; done
  pgrep -f -- "$partial/" >/dev/null && fail "an interrupted pith up left processes running"
  echo "  ok: an interrupted pith up left nothing running"
fi
rc=0
"$PITH" up --dir "$partial" --stores 1000 2>"$E2E_TMP/err" || rc=$?
[[ $rc == 2 ]] && grep -q "a local cluster takes at most 64 stores" "$E2E_TMP/err" ||
  fail "pith up --stores 1000 exited $rc: $(cat "$E2E_TMP/err")"

# A store drained, then stopped, is retired: its folder says so, and pith up starts it no
# more (nor does pith-store on that folder).
"$PITH" up --stores 2 >"$E2E_TMP/up.txt" 2>&1 || fail "pith up: $(cat "$E2E_TMP/up.txt")"
wait_alive store 2 30
"$PITH" cancel "$job" >/dev/null 2>&1 || true
# The drain counts running jobs' stores: the cancelled job's run ends at a tick.
for _ in $(seq 20); do
  "$PITH" cluster drain store-0 --timeout 60 >"$E2E_TMP/drain.txt" 2>&1 && break
  grep -q "would leave" "$E2E_TMP/drain.txt" || break
  sleep 0.5
done
grep -q "can be stopped now" "$E2E_TMP/drain.txt" ||
  fail "pith cluster drain: $(cat "$E2E_TMP/drain.txt")"
# It is stopped while the coordinator is gone: it goes by what the last heartbeat said.
for _ in $(seq 100); do grep -q "is drained: it can be stopped" "$PITH_HOME/store0.log" && break; sleep 0.1; done
grep -q "is drained: it can be stopped" "$PITH_HOME/store0.log" || fail "no heartbeat told store0"
kill_and_wait "$(pid_of coordinator)"
store0=$(pid_of store0)
kill "$store0"
for _ in $(seq 100); do kill -0 "$store0" 2>/dev/null || break; sleep 0.1; done
[[ -e $PITH_HOME/store0/DRAINED ]] || fail "the drained store0 left no mark in its folder"
"$PITH" up >"$E2E_TMP/up.txt" 2>&1 || fail "pith up after the drain: $(cat "$E2E_TMP/up.txt")"
grep -q "store0 was drained and stopped: not started again" "$E2E_TMP/up.txt" ||
  fail "pith up after the drain said: $(cat "$E2E_TMP/up.txt")"
grep -q "restarted coordinator (store1, " "$E2E_TMP/up.txt" ||
  fail "pith up restarted more than the coordinator: $(cat "$E2E_TMP/up.txt")"
[[ -z $(pid_of store0) ]] || fail "store0 stayed in the record"
echo "  ok: $(head -1 "$E2E_TMP/up.txt")"
# A fresh start keeps the count: the next store name takes the retired one's place.
"$PITH" down >/dev/null || fail "pith down"
"$PITH" up >"$E2E_TMP/up.txt" 2>&1 || fail "pith up after down: $(cat "$E2E_TMP/up.txt")"
grep -q "store0 was drained and stopped" "$E2E_TMP/up.txt" && [[ -n $(pid_of store2) ]] ||
  fail "a fresh start with a retired store0: $(cat "$E2E_TMP/up.txt")"
wait_alive store 2 30
echo "  ok: a fresh start ran store1 and store2"
"$PITH" down >/dev/null || fail "pith down"
echo "PASS"
