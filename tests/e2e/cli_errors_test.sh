#!/usr/bin/env bash
# The real `pith` binary answers a malformed safetensors file and an invalid JobSpec with
# exit status 1 and exactly one readable line on stderr, and accepts the good ones.
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
# A usage error (exit 2): nothing starts, one line says why.
if "$PITH" up --backend tpu --dir "$E2E_TMP/up" 2>"$E2E_TMP/err"; then fail "up --backend tpu ran"; fi
grep -q 'up: --backend wants cpu or cuda, got "tpu"' "$E2E_TMP/err" ||
  fail "up --backend tpu: $(cat "$E2E_TMP/err")"
[[ ! -e "$E2E_TMP/up" ]] || fail "up --backend tpu made its folder"
echo "cli errors: OK"
