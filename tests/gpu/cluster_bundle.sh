#!/usr/bin/env bash
# Packs a local cluster for a GPU machine that has CUDA but none of Pith's other
# dependencies (the lent one): the four binaries of a CUDA build and the CUDA backend's
# module pith-worker loads from beside itself, the shared libraries
# they load that are neither glibc's nor CUDA's (gRPC, protobuf, UCX, RocksDB, OpenBLAS,
# ...), and UCX's transport modules, into .gpu-cluster/pith-cluster.tar.gz (ignored by
# git; carry .gpu-cluster). tests/gpu/cluster.sh unpacks and runs it there.
#
#   tests/gpu/cluster_bundle.sh [BUILD_DIR]     # here, after a build with nvcc
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
bins=("$build/client/pith" "$build/server/coordinator/pith-coordinator"
      "$build/server/store/pith-store" "$build/worker/pith-worker")
for b in "${bins[@]}"; do [[ -x $b ]] || { echo "cluster_bundle: no $b: build first" >&2; exit 1; }; done
plugin=$build/worker/libpith_cuda_backend.so
# The module's name is in pith-worker only when the build has the CUDA backend (a module
# left from an earlier configuration proves nothing).
if [[ ! -f $plugin ]] || ! grep -q libpith_cuda_backend.so "$build/worker/pith-worker"; then
  echo "cluster_bundle: $build/worker/pith-worker has no CUDA backend (no nvcc at build)" >&2
  exit 1
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib/ucx"
cp "${bins[@]}" "$plugin" "$stage/bin/"
# UCX's transport modules: cma only. The RDMA ones (ib, rdmacm) would need this machine's
# verbs providers, which are not shipped, and rdmacm names ib as a library, which put a
# second copy of it beside the binaries' libraries; the bundle's cluster talks TCP on lo
# (tests/gpu/cluster.sh).
ucx_modules=(/usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0)
cp -L "${ucx_modules[@]}" "$stage/lib/ucx/"
# Everything the binaries and modules load, but glibc's own (the GPU machine's glibc must
# be at least as new as this one's) and CUDA's (it has its driver and toolkit).
skip='/(libc|libm|libmvec|libdl|librt|libpthread|libresolv|libutil|libanl|libnss_[a-z]*|ld-linux-x86-64|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z-]*)\.so'
for f in "${bins[@]}" "$plugin" "${ucx_modules[@]}"; do ldd "$f"; done | awk '/=> \// {print $3}' |
  sort -u | grep -Ev "$skip" | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
mkdir -p "$root/.gpu-cluster"
tar -C "$stage" -czf "$root/.gpu-cluster/pith-cluster.tar.gz" bin lib
echo "cluster_bundle: $(du -h "$root/.gpu-cluster/pith-cluster.tar.gz" | cut -f1) in" \
     ".gpu-cluster/pith-cluster.tar.gz ($(ls "$stage/lib" | wc -l) libraries)"
