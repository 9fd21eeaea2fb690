#!/usr/bin/env bash
# The Python client (client/python, built into BUILD/python) against a live local cluster
# that `pith up` starts with mutual TLS: client/python/pith_client_test.py.
set -euo pipefail
PITH=$1
PYTHON_DIR=$2
source "$(dirname "$0")/../../deploy/proc-lib.sh"
if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "SKIP: Debian's python3-grpcio and python3-protobuf are not installed (deploy/install-deps.sh)"
  exit 77
fi
[[ -f $PYTHON_DIR/pith/v1/job_pb2_grpc.py ]] || fail "no generated Python client in $PYTHON_DIR"
export PITH_HOME=$E2E_TMP/home
trap '"$PITH" down >/dev/null 2>&1 || true; cleanup' EXIT
"$PITH" up --stores 1 --workers 2 >"$E2E_TMP/up.txt" || fail "pith up: $(cat "$E2E_TMP/up.txt")"
tiny_tokens "$PITH" 200
PITH_CLI=$PITH PITH_TEST_TOKENS=$E2E_TMP/tokens.bin PYTHONPATH=$PYTHON_DIR \
  /usr/bin/python3 -P "$(dirname "$0")/../../client/python/pith_client_test.py" ||
  fail "the Python client test failed"
echo "python client: OK"
