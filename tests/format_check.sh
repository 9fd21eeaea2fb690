#!/usr/bin/env bash
# Fails when any C++/CUDA source differs from what clang-format (Google base, .clang-format)
# would write. Fix with: clang-format -i <files>
set -euo pipefail
cd "$1"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -co --exclude-standard '*.cc' '*.h' '*.cu' '*.cuh')
else
  mapfile -t files < <(find common server worker client tests -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
fi
((${#files[@]} > 0)) || { echo "no sources found" >&2; exit 1; }
clang-format --dry-run -Werror "${files[@]}"
echo "clang-format: ${#files[@]} files clean"
