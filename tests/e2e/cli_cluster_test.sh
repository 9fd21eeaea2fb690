#!/usr/bin/env bash
# The `pith` CLI against a real local cluster: up, submit (text and --output json),
# watch, status, checkpoint, sample, cancel, remove, cluster, down; and bad input — an unknown job,
# an invalid spec (the bad field named), an unreachable coordinator (one line, exit 1,
# within the deadline).
set -euo pipefail
PITH=$1
source "$(dirname "$0")/../../deploy/proc-lib.sh"
export PITH_HOME=$E2E_TMP/home
trap '"$PITH" down >/dev/null 2>&1 || true; cleanup' EXIT

expect_one_line() {  # WANT CMD...: exit 1, one stderr line containing WANT
  local want=$1 rc=0
  shift
  "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
  [[ $rc == 1 ]] || fail "$* exited $rc, want 1"
  [[ $(wc -l <"$E2E_TMP/err") == 1 ]] || fail "$* printed not one line: $(cat "$E2E_TMP/err")"
  grep -q -- "$want" "$E2E_TMP/err" || fail "$* error lacks '$want': $(cat "$E2E_TMP/err")"
  echo "  ok: $(cat "$E2E_TMP/err")"
}

"$PITH" up --stores 2 --workers 2 --cache_bytes 4096 || fail "pith up"
tiny_tokens "$PITH" 300
tiny_spec tiny 15 1 >"$E2E_TMP/tiny.json"
tiny_spec long 1000000 1 | sed 's/"store_replicas": 2/"store_replicas": 3/' >"$E2E_TMP/long.json"

job=$("$PITH" submit "$E2E_TMP/tiny.json")
[[ -n $job ]] || fail "submit printed no job id"
"$PITH" watch "$job" >"$E2E_TMP/watch.txt" || fail "watch: $(tail -3 "$E2E_TMP/watch.txt")"
grep -q "succeeded at step 15" "$E2E_TMP/watch.txt" || fail "watch summary: $(tail -2 "$E2E_TMP/watch.txt")"
grep -q "step 15/15" "$E2E_TMP/watch.txt" || fail "no progress line for the last step"
"$PITH" status "$job" --output json | grep '"state":"JOB_STATE_SUCCEEDED"' >/dev/null ||
  fail "status --output json: $("$PITH" status "$job" --output json)"
# Its submitter (pith up's admin certificate) and the token file it trained on, pinned.
data_bytes=$(stat -c %s "$E2E_TMP/tokens.bin")
"$PITH" status "$job" --output json | grep '"owner":"admin"' | grep -q "\"data\":{\"bytes\":\"$data_bytes\"" ||
  fail "owner and data: $("$PITH" status "$job" --output json)"
"$PITH" checkpoint "$job" --out "$E2E_TMP/tiny.safetensors" >/dev/null || fail "checkpoint"
"$PITH" safetensors inspect "$E2E_TMP/tiny.safetensors" >/dev/null || fail "checkpoint unreadable"
# The file came down the stream: the coordinator kept no copy, nothing partial is left.
[[ -z $(find "$PITH_HOME" -path '*downloads/*' -type f) ]] || fail "the coordinator kept a download"
[[ -z $(ls "$E2E_TMP"/tiny.safetensors.partial-* 2>/dev/null) ]] || fail "a partial download is left"
# An existing file is kept, unless --force says to replace it.
expect_one_line "tiny.safetensors already exists and is not replaced (--force replaces it)" \
  "$PITH" checkpoint "$job" --out "$E2E_TMP/tiny.safetensors"
"$PITH" checkpoint "$job" --out "$E2E_TMP/tiny.safetensors" --force >/dev/null || fail "--force"
# The export records its job's spec: sample and eval need nothing else.
"$PITH" sample --checkpoint "$E2E_TMP/tiny.safetensors" --prompt "line" --tokens 10 >/dev/null ||
  fail "sample"
"$PITH" eval --checkpoint "$E2E_TMP/tiny.safetensors" --tokens "$E2E_TMP/tokens.bin" \
  --batches 2 | grep "eval rows=8" >/dev/null || fail "eval"
"$PITH" experts "$job" --svg "$E2E_TMP/heat.svg" >"$E2E_TMP/experts.txt" || fail "experts"
grep -q "layer  0: hottest expert" "$E2E_TMP/experts.txt" || fail "experts: $(cat "$E2E_TMP/experts.txt")"
grep -q "<svg" "$E2E_TMP/heat.svg" && grep -q "layer 0" "$E2E_TMP/heat.svg" || fail "no heat map svg"
# The job has ended: its cells count fetches, not the replicas of a placement that is gone.
grep -q "label: fetches into caches; the job has no placement now" "$E2E_TMP/heat.svg" ||
  fail "the ended job's heat map labels replicas: $(grep -m1 label "$E2E_TMP/heat.svg")"
echo "  ok: trained, watched, checkpointed, sampled and drew the experts of $job"

long=$("$PITH" --output json submit "$E2E_TMP/long.json" 2>"$E2E_TMP/long.err" |
  sed 's/.*"job_id": "\([^"]*\)".*/\1/')
[[ -n $long ]] || fail "submit --output json"
# Three store copies asked of two stores: the job runs, and submit says what it keeps.
grep -q "asks 3 store copies of each group and 2 stores are alive" "$E2E_TMP/long.err" ||
  fail "no note on the store copies: $(cat "$E2E_TMP/long.err")"
for _ in $(seq 100); do
  "$PITH" status "$long" | grep running >/dev/null && break
  sleep 0.1
done
expect_one_line "job $long is running; only an ended job is removed" "$PITH" remove "$long"
"$PITH" cancel "$long" >/dev/null || fail "cancel"
"$PITH" status "$long" | grep cancelled >/dev/null || fail "not cancelled: $("$PITH" status "$long")"
"$PITH" cluster --output json | grep '"workers"' >/dev/null || fail "cluster --output json"
echo "  ok: cancelled $long"

# A job that cannot run (its data file exists nowhere) fails with the reason, soon.
sed "s|$E2E_TMP/tokens.bin|$E2E_TMP/missing.bin|" "$E2E_TMP/tiny.json" >"$E2E_TMP/nodata.json"
nodata=$("$PITH" submit "$E2E_TMP/nodata.json")
start=$(date +%s)
rc=0
timeout 120 "$PITH" watch "$nodata" >"$E2E_TMP/nodata.txt" 2>&1 || rc=$?
[[ $rc == 1 ]] || fail "watch of a job without data exited $rc: $(tail -2 "$E2E_TMP/nodata.txt")"
"$PITH" status "$nodata" >"$E2E_TMP/nodata.status"
grep -q failed "$E2E_TMP/nodata.status" && grep -q "missing.bin" "$E2E_TMP/nodata.status" ||
  fail "status of a job without data: $(cat "$E2E_TMP/nodata.status")"
(($(date +%s) - start <= 60)) || fail "the job without data took over 60 s to fail"
# So does one whose train.init_path is no file: at its first attempt, not its eighth.
sed "s|\"lr\": 0.01|\"lr\": 0.01, \"init_path\": \"$E2E_TMP/missing.safetensors\"|" \
  "$E2E_TMP/tiny.json" >"$E2E_TMP/noinit.json"
noinit=$("$PITH" submit "$E2E_TMP/noinit.json")
rc=0
timeout 60 "$PITH" watch "$noinit" >"$E2E_TMP/noinit.txt" 2>&1 || rc=$?
[[ $rc == 1 ]] || fail "watch of a job without its init file exited $rc"
"$PITH" status "$noinit" | grep -q "failed .*(worker worker-[01]: train.init_path: no file" ||
  fail "status of a job without its init file: $("$PITH" status "$noinit")"
echo "  ok: $nodata failed in $(($(date +%s) - start)) s: $(grep -o "step.*" "$E2E_TMP/nodata.status" | head -1)"
# No job reads the cluster's own folder: its CA key trained on would be sampled back.
sed "s|$E2E_TMP/tokens.bin|$PITH_HOME/tls/ca.key|" "$E2E_TMP/tiny.json" >"$E2E_TMP/steal.json"
steal=$("$PITH" submit "$E2E_TMP/steal.json")
timeout 60 "$PITH" watch "$steal" >/dev/null 2>&1 || true
"$PITH" status "$steal" | grep -q "failed .*ca.key lies in .*, which this worker keeps from jobs" ||
  fail "a job read the cluster's CA key: $("$PITH" status "$steal")"

# Mutual TLS on every port (pith up made the certificates; the CLI used admin's): a
# member's certificate cannot submit or drain; a user's reaches its own jobs only, and
# cannot drain.
tls=$PITH_HOME/tls
expect_one_line "SubmitJob needs the admin or user role; the caller is worker0 (member)" \
  "$PITH" --tls_dir "$tls/worker0" submit "$E2E_TMP/tiny.json"
expect_one_line "DrainStore needs the admin role; the caller is worker0 (member)" \
  "$PITH" --tls_dir "$tls/worker0" cluster drain store-0 --no-wait
"$PITH" certs --dir "$tls" --name alice --role user >/dev/null || fail "pith certs"
expect_one_line "GetJob: job $job was not submitted by the caller, alice (user)" \
  "$PITH" --tls_dir "$tls/alice" status "$job"
[[ $("$PITH" --tls_dir "$tls/alice" status) == "no jobs" ]] || fail "a user lists another's jobs"
own=$("$PITH" --tls_dir "$tls/alice" submit "$E2E_TMP/tiny.json") || fail "a user cannot submit"
"$PITH" --tls_dir "$tls/alice" watch "$own" >/dev/null || fail "a user cannot watch its job"
"$PITH" --tls_dir "$tls/alice" status | grep "^$own .*succeeded" >/dev/null ||
  fail "a user's own job: $("$PITH" --tls_dir "$tls/alice" status)"
expect_one_line "DrainStore needs the admin role; the caller is alice (user)" \
  "$PITH" --tls_dir "$tls/alice" cluster drain store-0 --no-wait
"$PITH" cluster | grep "store-0.*alive" >/dev/null || fail "a refused drain changed the store: $("$PITH" cluster)"
# Each store's free disk, as its heartbeat last said (a real figure, not a zero).
"$PITH" cluster | grep -E "store-0 .*disk free [1-9][0-9.]* MB" >/dev/null ||
  fail "no disk figure for store-0: $("$PITH" cluster)"
# A bearer token instead of a certificate (the CA alone beside it, to check the server).
mkdir -p "$E2E_TMP/ca-only" && cp "$tls/ca.pem" "$E2E_TMP/ca-only/"
token=$("$PITH" token --file "$tls/tokens" --name bob) || fail "pith token"
sleep 1.2  # the coordinator looks at its tokens file once a second
expect_one_line "was not submitted by the caller, bob (user)" \
  env PITH_TOKEN="$token" "$PITH" --tls_dir "$E2E_TMP/ca-only" status "$job"
expect_one_line "the bearer token is not valid" \
  "$PITH" --tls_dir "$E2E_TMP/ca-only" --token "${token}x" status "$job"
expect_one_line "DrainStore needs the admin role; the caller is bob (user)" \
  "$PITH" --tls_dir "$E2E_TMP/ca-only" --token "$token" cluster drain store-0 --no-wait
# A new token for bob replaces the old one; a revocation ends the new one.
rotated=$("$PITH" token --file "$tls/tokens" --name bob 2>"$E2E_TMP/rotate.err") || fail "pith token again"
grep -q "bob's earlier token no longer works" "$E2E_TMP/rotate.err" ||
  fail "the rotation said: $(cat "$E2E_TMP/rotate.err")"
sleep 1.2
expect_one_line "the bearer token is not valid" \
  "$PITH" --tls_dir "$E2E_TMP/ca-only" --token "$token" status "$job"
[[ $(PITH_TOKEN=$rotated "$PITH" --tls_dir "$E2E_TMP/ca-only" status) == "no jobs" ]] ||
  fail "bob's new token cannot list his jobs"
"$PITH" token --revoke --file "$tls/tokens" --name bob | grep -q "revoked bob's token" ||
  fail "pith token --revoke"
sleep 1.2
expect_one_line "the bearer token is not valid" \
  "$PITH" --tls_dir "$E2E_TMP/ca-only" --token "$rotated" status "$job"
# A token made to expire works until then; one past its expiry is refused saying when.
carol=$("$PITH" token --file "$tls/tokens" --name carol --expires_in 30m 2>"$E2E_TMP/carol.err") ||
  fail "pith token --expires_in"
grep -q "the token expires at 20[0-9-]* [0-9:]* UTC" "$E2E_TMP/carol.err" ||
  fail "the expiring token said: $(cat "$E2E_TMP/carol.err")"
echo "dave user $(printf %s pith_old | sha256sum | cut -c1-64) expires=2020-01-02T03:04:05Z" \
  >>"$tls/tokens"
sleep 1.2
[[ $("$PITH" --tls_dir "$E2E_TMP/ca-only" --token "$carol" status) == "no jobs" ]] ||
  fail "carol's token (30 minutes left) does not work"
expect_one_line "the bearer token of dave expired at 2020-01-02 03:04:05 UTC" \
  "$PITH" --tls_dir "$E2E_TMP/ca-only" --token pith_old status

expect_one_line "no job nope" "$PITH" status nope
expect_one_line "no job nope" "$PITH" checkpoint nope --out "$E2E_TMP/nope.safetensors"
[[ -z $(ls "$E2E_TMP"/nope.safetensors* 2>/dev/null) ]] || fail "a failed download left a file"
sed 's/"n_head": 2/"n_head": 3/' "$E2E_TMP/tiny.json" >"$E2E_TMP/bad.json"
expect_one_line "model.n_head" "$PITH" submit "$E2E_TMP/bad.json"
start=$(date +%s)
expect_one_line "127.0.0.1:1" "$PITH" --coordinator 127.0.0.1:1 status
(($(date +%s) - start <= 10)) || fail "the unreachable coordinator took over 10 s"

# Every job removed (all have ended): gone from status, and every byte of theirs from
# the stores (the succeeded one's kept weights too), soon.
store_bytes() {
  "$PITH" cluster --output json | grep -o '"\(ram\|rocksdb\)_bytes":"[0-9]*"' |
    grep -o '[0-9]*' | awk '{ s += $1 } END { print s + 0 }'
}
(($(store_bytes) > 0)) || fail "the stores hold nothing of the ended jobs: $("$PITH" cluster --output json)"
mapfile -t jobs < <("$PITH" status --output json | grep -o '"job_id":"[^"]*"' | cut -d'"' -f4)
((${#jobs[@]} >= 5)) || fail "status listed ${#jobs[@]} jobs"
# An id that names no job among them is named in one error line, and the rest still go.
expect_one_line "1 of $((${#jobs[@]} + 1)) jobs not removed: no job nope" \
  "$PITH" remove "${jobs[0]}" nope "${jobs[@]:1}"
grep -q "removed $job (succeeded)" "$E2E_TMP/out" || fail "remove said $(cat "$E2E_TMP/out")"
(($(grep -c '^removed ' "$E2E_TMP/out") == ${#jobs[@]})) || fail "remove said $(cat "$E2E_TMP/out")"
expect_one_line "job $job was removed" "$PITH" status "$job"
[[ $("$PITH" status) == "no jobs" ]] || fail "removed jobs are listed: $("$PITH" status)"
for _ in $(seq 60); do
  [[ $(store_bytes) == 0 ]] && break
  sleep 1
done
[[ $(store_bytes) == 0 ]] || fail "the stores still hold $(store_bytes) bytes of removed jobs"
echo "  ok: removed ${#jobs[@]} jobs; the stores hold none of their bytes"

"$PITH" down >/dev/null || fail "pith down"
[[ ! -f $PITH_HOME/pids ]] || fail "down left the cluster recorded"
# down again: nothing to stop, said, exit 0 (as up with everything running)
"$PITH" down >"$E2E_TMP/down2.txt" || fail "a second pith down: $(cat "$E2E_TMP/down2.txt")"
grep -q "nothing to stop" "$E2E_TMP/down2.txt" || fail "a second down said: $(cat "$E2E_TMP/down2.txt")"

# A coordinator that could not hold a second job refuses it at submit, with the reason;
# the first job is untouched.
bin=$(dirname "$(readlink -f "$PITH")")/..
start_proc coord "$bin/server/coordinator/pith-coordinator" --listen=127.0.0.1:0 \
  --metrics_port=-1 --data_dir="$E2E_TMP/coord" --jobs_memory_bytes=3000000 \
  --tls_dir="$PITH_HOME/tls/coordinator"
wait_ready coord
first=$("$PITH" --coordinator "127.0.0.1:$GRPC_PORT_coord" submit "$E2E_TMP/tiny.json") ||
  fail "the first job was refused"
expect_one_line "the coordinator cannot hold this job" \
  "$PITH" --coordinator "127.0.0.1:$GRPC_PORT_coord" submit "$E2E_TMP/tiny.json"
"$PITH" --coordinator "127.0.0.1:$GRPC_PORT_coord" status "$first" | grep pending >/dev/null ||
  fail "the first job changed"
stop_proc coord
echo "PASS"
