#!/usr/bin/env bash
# The README test command: installs what is missing, builds everything with warnings as
# errors, and runs the whole CTest suite (unit, e2e, fuzz smoke, format check).
# Usage: deploy/test.sh [extra ctest arguments, e.g. -L unit or -R safetensors]
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh

BUILD_DIR=${PITH_BUILD_DIR:-build}
JOBS=${PITH_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPITH_WERROR=ON >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS"
cd "$BUILD_DIR"
ctest --output-on-failure -j"$JOBS" --timeout 600 "$@"
