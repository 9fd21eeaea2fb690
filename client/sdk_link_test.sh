#!/usr/bin/env bash
# Acceptance check of the job-API SDK's layering: a program built against `pith_client`
# alone (client/examples/sdk_example.cc) links protos, gRPC and Abseil, and no OpenBLAS,
# compute engine, model code or Pith process library.
#
# Usage: sdk_link_test.sh SDK_EXAMPLE LINK_LIBRARIES_FILE [LINK_TXT]
#   LINK_LIBRARIES_FILE: "target: lib;lib;..." lines that CMake writes at generation
#   LINK_TXT: the example's link command (Makefile generator; skipped when absent)
set -euo pipefail

BIN=${1:?usage: sdk_link_test.sh SDK_EXAMPLE LINK_LIBRARIES_FILE [LINK_TXT]}
LIBS=${2:?usage: sdk_link_test.sh SDK_EXAMPLE LINK_LIBRARIES_FILE [LINK_TXT]}
LINK_TXT=${3:-}
failed=0
fail() {
  echo "sdk_link_test: FAIL: $*" >&2
  failed=1
}

# 1. Shared libraries: no BLAS, nor what only servers need.
echo "== ldd $BIN"
ldd "$BIN"
if bad=$(ldd "$BIN" | grep -Ei 'openblas|libblas|libcblas|lapack|glog|prometheus|rocksdb|libucp|libucs'); then
  fail "the SDK example loads: $bad"
fi

# 2. Symbols: no model, compute or data code, no BLAS statically linked in.
if bad=$(nm -C "$BIN" | grep -E 'pith::(model|compute|data|coordinator|store)::|cblas_|sgemm_' | head -5); then
  fail "the SDK example holds symbols of model/compute code: $bad"
fi

# 3. The targets' link libraries: protos, gRPC, Abseil and the SDK's own libraries only.
echo "== link libraries"
cat "$LIBS"
while IFS= read -r line; do
  target=${line%%:*}
  IFS=';' read -r -a deps <<<"${line#*: }"
  for dep in "${deps[@]}"; do
    [[ -z "$dep" ]] && continue
    [[ "$dep" =~ ^(pith_proto|pith_grpc_status|pith_security|OpenSSL::Crypto|gRPC::[A-Za-z0-9_+]+|absl::[a-z0-9_]+|protobuf::[a-z]+)$ ]] ||
      fail "$target links $dep (the SDK may link only protos, gRPC, OpenSSL and Abseil)"
  done
done <"$LIBS"

# 4. The link command itself, when the generator wrote one.
if [[ -n "$LINK_TXT" && -f "$LINK_TXT" ]]; then
  if bad=$(tr ' ' '\n' <"$LINK_TXT" |
           grep -E 'libpith_(model|compute|data|inference|cli|common|process|trainer)\.a|openblas|blas\.|glog|prometheus'); then
    fail "the SDK example's link line names: $(echo $bad)"
  fi
fi

[[ $failed -eq 0 ]] && echo "sdk_link_test: OK (no BLAS, no model/compute code, SDK links protos+gRPC+Abseil)"
exit $failed
