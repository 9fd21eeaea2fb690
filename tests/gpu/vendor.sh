#!/usr/bin/env bash
# Puts the sources the GPU-only build needs (Abseil, GoogleTest) in .gpu-deps/ at the
# repository root, for a GPU machine that has neither and no package registry: the
# device run carries the folder (ignored by git, ~12 MB). Run on a Debian 12 machine
# like the development one: GoogleTest from /usr/src/googletest (the googletest package),
# Abseil from Debian's source archive, the version Pith builds against there.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
deps="$root/.gpu-deps"
mkdir -p "$deps"

if [[ ! -f "$deps/googletest/CMakeLists.txt" ]]; then
  if [[ ! -f /usr/src/googletest/CMakeLists.txt ]]; then
    apt-get install -y -qq googletest >/dev/null
  fi
  rm -rf "$deps/googletest"
  cp -r /usr/src/googletest "$deps/googletest"
fi

if [[ ! -f "$deps/abseil-cpp/CMakeLists.txt" ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists/partial"
  printf 'deb-src http://deb.debian.org/debian bookworm main\n' >"$work/sources.list"
  apt=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
  apt-get "${apt[@]}" update -qq
  (cd "$work" && apt-get "${apt[@]}" source --download-only -qq abseil 2>/dev/null)
  tarball=$(ls "$work"/abseil_*.orig.tar.gz)
  mkdir -p "$work/src"
  tar -xzf "$tarball" -C "$work/src"
  rm -rf "$deps/abseil-cpp"
  mv "$work/src"/abseil-* "$deps/abseil-cpp"
fi
du -sh "$deps"
