#!/usr/bin/env bash
# The clang leg of the test command: every Pith translation unit of a build goes through
# clang's front end with -Wthread-safety -Werror, so the ABSL_GUARDED_BY / ABSL_LOCKS_EXCLUDED
# annotations are checked by the compiler, not decorative. The compile lines come from the
# build's compile_commands.json (the same include paths and defines as the real build);
# only the front end runs (-fsyntax-only: thread-safety analysis needs no code generation).
#
# Usage: tests/thread_safety_check.sh BUILD_DIR [PATH_REGEX]
#   PATH_REGEX limits the check to sources whose path matches (e.g. 'server/store/').
set -euo pipefail

BUILD_DIR=${1:?usage: thread_safety_check.sh BUILD_DIR [PATH_REGEX]}
FILTER=${2:-.}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CLANG=${PITH_CLANG:-clang++}
JOBS=${PITH_JOBS:-$(nproc)}

command -v "$CLANG" >/dev/null || { echo "thread_safety_check: $CLANG not found" >&2; exit 1; }
[[ -f "$BUILD_DIR/compile_commands.json" ]] ||
  { echo "thread_safety_check: no $BUILD_DIR/compile_commands.json (configure first)" >&2; exit 1; }

# One line per Pith C++ source: "<file>\t<flags>\t<dir>" with the compiler, -o, -c,
# -Werror and sanitizer flags removed (the check adds its own -Werror). Generated protobuf
# code (under the build folder) and CUDA are not Pith's to annotate.
LIST=$(mktemp)
trap 'rm -f "$LIST"' EXIT
python3 - "$BUILD_DIR/compile_commands.json" "$ROOT" "$FILTER" "$(cd "$BUILD_DIR" && pwd)" >"$LIST" <<'EOF'
import json, re, shlex, sys
db, root, pattern = json.load(open(sys.argv[1])), sys.argv[2], re.compile(sys.argv[3])
build = sys.argv[4] + "/"
seen = set()
for entry in db:
    f = entry["file"]
    if not f.startswith(root + "/") or f.startswith(build) or not f.endswith(".cc"):
        continue
    rel = f[len(root) + 1:]
    if rel in seen or not pattern.search(rel):
        continue
    seen.add(rel)
    args = shlex.split(entry["command"])[1:]
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = a == "-o"
            continue
        if a == f or a.startswith("-fsanitize") or a == "-Werror":
            continue
        keep.append(a)
    print(rel + "\t" + " ".join(shlex.quote(a) for a in keep) + "\t" + entry["directory"])
EOF

COUNT=$(wc -l <"$LIST")
((COUNT > 0)) || { echo "thread_safety_check: no sources match '$FILTER'" >&2; exit 1; }

check_one() {
  local rel=$1 flags=$2 dir=$3
  # shellcheck disable=SC2086
  (cd "$dir" && eval "$CLANG" $flags -fsyntax-only -Wthread-safety -Werror \
     -Wno-unused-command-line-argument "$ROOT/$rel") || { echo "FAILED: $rel"; return 1; }
}
export -f check_one
export CLANG ROOT

FAILED=0
tr '\t' '\036' <"$LIST" | xargs -d '\n' -P "$JOBS" -I{} bash -c \
  'IFS=$'"'"'\036'"'"' read -r rel flags dir <<<"$1"; check_one "$rel" "$flags" "$dir"' _ {} ||
  FAILED=1
if ((FAILED)); then
  echo "thread_safety_check: clang -Wthread-safety found errors (see above)" >&2
  exit 1
fi
echo "thread_safety_check: $COUNT translation units clean under clang -Wthread-safety -Werror"
