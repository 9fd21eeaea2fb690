#!/usr/bin/env bash
# The real `pith` binary answers a malformed safetensors file, an invalid or truncated
# JobSpec and a failed TLS handshake with exit status 1 and exactly one readable line on
# stderr, and accepts the good ones.
set -euo pipefail
PITH=$1 CORPUS=$2
source "$(dirname "$0")/../../deploy/proc-lib.sh"

# expect_one_line WANT CMD...: CMD exits 1 and prints one stderr line containing WANT.
expect_one_line() {
  local want=$1 rc=0
  shift
  "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
  [[ $rc == 1 ]] || fail "$* exited $rc, want 1"
  [[ $(wc -l <"$E2E_TMP/err") == 1 ]] || fail "$* printed not one line: $(cat "$E2E_TMP/err")"
  grep -q -- "$want" "$E2E_TMP/err" || fail "$* error lacks '$want': $(cat "$E2E_TMP/err")"
  echo "  ok: $(cat "$E2E_TMP/err")"
}

"$PITH" spec check "$CORPUS/job_spec/design_example.json" >/dev/null || fail "good spec rejected"
"$PITH" safetensors inspect "$CORPUS/safetensors/two_tensors.safetensors" >/dev/null ||
  fail "good safetensors rejected"

expect_one_line "JobSpec model.n_head" "$PITH" spec check "$CORPUS/job_spec/bad_heads.json"
printf '\x10\x00\x00\x00\x00\x00\x00\x00{"a":1}' >"$E2E_TMP/bad.safetensors"
expect_one_line "safetensors: " "$PITH" safetensors inspect "$E2E_TMP/bad.safetensors"
good="$CORPUS/safetensors/two_tensors.safetensors"
head -c $(($(stat -c %s "$good") - 4)) "$good" >"$E2E_TMP/cut.safetensors"
expect_one_line "safetensors: truncated: tensor" "$PITH" safetensors inspect "$E2E_TMP/cut.safetensors"
printf '{"model": {"n_layer": 2' >"$E2E_TMP/cut.json"
expect_one_line "JobSpec JSON: Unexpected end" "$PITH" spec check "$E2E_TMP/cut.json"
# A TLS handshake that fails (here a plain HTTP server): gRPC's own log lines stay out of
# it, one line says what to check.
"$PITH" certs --dir "$E2E_TMP/ca" --name admin --role admin >/dev/null || fail "pith certs"
/usr/bin/python3 -u -m http.server 0 --bind 127.0.0.1 >"$E2E_TMP/http.txt" 2>&1 &
http_pid=$!
PIDS+=("$http_pid")  # cleanup's, should the test fail before it ends it
for _ in $(seq 50); do grep -q "port" "$E2E_TMP/http.txt" && break; sleep 0.1; done
http_port=$(sed -n 's/.* port \([0-9]*\).*/\1/p' "$E2E_TMP/http.txt" | head -1)
[[ -n $http_port ]] || fail "no HTTP server to dial: $(cat "$E2E_TMP/http.txt")"
expect_one_line "no TLS handshake with the coordinator came up" timeout 60 "$PITH" --coordinator "127.0.0.1:$http_port" \
  --tls_dir "$E2E_TMP/ca/admin" status
kill "$http_pid" 2>/dev/null || true
# A usage error (exit 2): nothing starts, one line says why.
if "$PITH" up --backend tpu --dir "$E2E_TMP/up" 2>"$E2E_TMP/err"; then fail "up --backend tpu ran"; fi
grep -q 'up: --backend wants cpu or cuda, got "tpu"' "$E2E_TMP/err" ||
  fail "up --backend tpu: $(cat "$E2E_TMP/err")"
[[ ! -e "$E2E_TMP/up" ]] || fail "up --backend tpu made its folder"
echo "cli errors: OK"
