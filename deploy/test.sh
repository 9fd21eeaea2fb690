#!/usr/bin/env bash
# The README test command: installs what is missing, builds everything with warnings as
# errors (gcc), checks every translation unit with clang -Wthread-safety -Werror (the clang
# leg: the lock annotations are compiler-checked), and runs the whole CTest suite (unit,
# e2e, fuzz smoke, format and shape checks).
# Usage: deploy/test.sh [extra ctest arguments, e.g. -L unit or -R safetensors]
#   With extra arguments the clang leg is skipped (a filtered run is a quick look);
#   PITH_CLANG_LEG=1 forces it, PITH_CLANG_LEG=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh

# Paths relative to the checkout in ccache's keys: another clone of the same tree reuses
# this machine's cached objects.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
BUILD_DIR=${PITH_BUILD_DIR:-build}
JOBS=${PITH_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPITH_WERROR=ON >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS"
if [[ ${PITH_CLANG_LEG:-$(($# == 0))} == 1 ]]; then
  PITH_JOBS=$JOBS tests/thread_safety_check.sh "$BUILD_DIR"
fi
cd "$BUILD_DIR"
ctest --output-on-failure -j"$JOBS" --timeout 600 "$@"
