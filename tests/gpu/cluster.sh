#!/usr/bin/env bash
# The cluster path on a GPU, on a machine without Pith's dependencies (the lent one): from
# .gpu-cluster/pith-cluster.tar.gz (tests/gpu/cluster_bundle.sh packs it where Pith builds),
# a local cluster (`pith up --backend cuda`: a coordinator, 2 stores, 2 workers on the GPU)
# trains a dropless tiny job, and `pith-worker --standalone --backend=cpu` trains the same
# spec alone; their exported weights must give the same held-out loss (`pith eval`, within
# 1e-4 relative). Then the same job in bf16 on the GPU workers: within 2e-2 of it (with
# PITH_CLUSTER_BACKEND=cpu, a dry run anywhere: refused at submit, no CUDA worker). Logs go
# to $OUT (the device tool brings them back), else to /tmp/pith-gpu-cluster. Exit 0 only
# when both trained and agree; 3 (skipped, with the reason) where this machine cannot run
# the bundle's CUDA module (it needs CUDA 13's libraries and a driver of 580 or later).
# PITH_CLUSTER_LIMIT_S (190) bounds the whole script: its waits end 15 s before it.
#
#   tests/gpu/cluster_bundle.sh build    # where Pith builds (with nvcc)
#   tests/gpu/cluster.sh                 # on the GPU machine, from the repository root
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/pith-gpu-cluster}
mkdir -p "$out"
bundle=$root/.gpu-cluster/pith-cluster.tar.gz
[[ -f $bundle ]] || { echo "cluster.sh: no $bundle: run tests/gpu/cluster_bundle.sh (and carry .gpu-cluster)" >&2; exit 2; }
# Under the repository, not /tmp: a /tmp mounted noexec would refuse the binaries and the
# module.
mkdir -p "$root/.gpu-cluster/run"
work=$(mktemp -d "$root/.gpu-cluster/run/XXXXXX")
# On the way out, also after a timeout: the cluster down (its processes run in sessions of
# their own, which timeout's signal does not reach; what pith down leaves is killed), its
# logs kept.
cleanup() {
  PITH_HOME=$work/local timeout 60 "$work/bin/pith" down >/dev/null 2>&1 ||
    awk '{print $2}' "$work/local/pids" 2>/dev/null | xargs -r kill -9 2>/dev/null
  cp "$work"/local/*.log "$out/" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
start=$(date +%s)
deadline=$((start + ${PITH_CLUSTER_LIMIT_S:-190} - 15))
# Seconds left for one wait (at least 5).
left() { local n=$((deadline - $(date +%s))); echo $((n > 5 ? n : 5)); }
tar -C "$work" -xzf "$bundle" || { echo "SUMMARY: FAILED: cannot unpack $bundle"; exit 1; }
# The bundle's libstdc++ and libgcc_s come from the building machine, whose glibc may be
# newer than this one's; this machine's own serve where they define every version tag
# (GLIBCXX_, CXXABI_, GCC_) the bundle's other files ask for.
wants=$(for f in "$work"/bin/* "$work"/lib/*.so*; do
          case ${f##*/} in libstdc++.so.6 | libgcc_s.so.1) continue ;; esac
          objdump -T "$f" 2>/dev/null
        done | awk '/\*UND\*/' | grep -oE '(GLIBCXX|CXXABI|GCC)_[0-9.]+' | sort -u)
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
host_cxx=$("$ldconfig" -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
host_gcc=$("$ldconfig" -p 2>/dev/null | awk '/libgcc_s\.so\.1 .*x86-64/ {print $NF; exit}')
if [[ -n $wants && -n $host_cxx && -n $host_gcc ]]; then
  have=$({ grep -aoE '(GLIBCXX|CXXABI)_[0-9.]+' "$host_cxx"; grep -aoE 'GCC_[0-9.]+' "$host_gcc"; } |
    sort -u)
  if [[ -z $(comm -23 <(echo "$wants") <(echo "$have")) ]]; then
    rm -f "$work/lib/libstdc++.so.6" "$work/lib/libgcc_s.so.1"
    echo "cluster.sh: this machine's $host_cxx and $host_gcc serve the bundle"
  fi
fi
# CUDA's libraries: the toolkit's, else those PyTorch's wheels bring (cuBLAS, the runtime,
# NCCL); the bundle's own first.
cuda_libs=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    for p in nvidia.__path__:
        for d in glob.glob(os.path.join(p, "*", "lib")):
            print(d)
except ImportError:
    pass
PY
)
# (No empty entries: one would mean the current folder.)
library_path=$work/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib $cuda_libs; do
  [[ -d $d ]] && library_path+=:$d
done
export LD_LIBRARY_PATH=$library_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The processes talk over TCP on lo, whatever this machine's fabric and the environment
# say: the bundle's UCX has no RDMA provider of this machine's, and the test is of Pith.
while read -r name; do unset "$name"; done < <(env | sed -n 's/^\(UCX_[A-Z_]*\)=.*/\1/p')
export UCX_MODULE_DIR=$work/lib/ucx UCX_TLS=tcp,self UCX_NET_DEVICES=lo NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
pith=$work/bin/pith
# One line in the summary, however many the reason has.
fail() { echo "SUMMARY: FAILED: $(printf '%s' "$*" | tr -s '\n\t' '| ')"; exit 1; }
skip() { echo "SUMMARY: skipped: $(printf '%s' "$*" | tr -s '\n\t' '| ')"; exit 3; }
# What the CUDA module loads here (cuBLAS, NCCL, the runtime, CUDA 13's): where this
# machine has no such libraries or an older driver, the bundle cannot run here at all.
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
if [[ -n $driver && ${driver%%.*} -lt 580 ]]; then
  skip "driver $driver: the bundle's CUDA module is built with CUDA 13 (driver 580 or later)"
fi
ldd -r "$work/bin/libpith_cuda_backend.so" >"$out/module-ldd.txt" 2>&1
cuda_missing='lib(cudart|cublas|cublasLt|nccl)\.so[^ ]* => not found'
if grep -qE "$cuda_missing" "$out/module-ldd.txt"; then
  skip "no CUDA 13 libraries here for the bundle's module:" \
    "$(grep -E "$cuda_missing" "$out/module-ldd.txt" | tr -s ' \t' ' ' | head -5)"
fi
# Anything else missing (a library, a glibc or libstdc++ version) is the bundle's fault.
if grep -q "not found" "$out/module-ldd.txt"; then
  fail "the bundle's module does not load here: $(grep "not found" "$out/module-ldd.txt" | head -5)"
fi
# The bundle's binaries need this machine's glibc to be at least the building one's.
"$pith" version >"$out/version.txt" 2>&1 || fail "the bundle does not run here: $(head -3 "$out/version.txt")"

for i in $(seq 300); do echo "line $i: experts come from the stores when they are needed."; done >"$work/text.txt"
"$pith" data prepare --out "$work/tokens.bin" "$work/text.txt" >/dev/null || fail "data prepare"
cat >"$work/spec.json" <<JSON
{"name": "gpucluster", "model": {"vocab_size": 256, "seq_len": 16, "d_model": 32,
 "n_layer": 2, "n_head": 2, "n_expert": 4, "top_k": 2, "d_ff": 64, "capacity_factor": 4.0,
 "aux_loss_coef": 0.01, "z_loss_coef": 0.001},
 "train": {"data_path": "$work/tokens.bin", "batch": 8, "steps": 20, "lr": 0.003,
 "warmup": 5, "seed": 1337}, "cluster": {"workers": 2, "store_replicas": 2}}
JSON

echo "== single process, CPU"
"$work/bin/pith-worker" --standalone --spec="$work/spec.json" --backend=cpu --threads=1 \
  --loss_log="$work/alone.log" --save="$work/alone.safetensors" >"$out/alone.log" 2>&1 ||
  fail "standalone: $(tail -3 "$out/alone.log")"
backend=${PITH_CLUSTER_BACKEND:-cuda}  # cpu: a dry run of this script where there is no GPU
echo "== local cluster, workers on $backend"
export PITH_HOME=$work/local
"$pith" up --stores 2 --workers 2 --backend "$backend" >"$out/up.log" 2>&1 ||
  fail "pith up: $(tail -3 "$out/up.log")"
# A worker says it is ready before it has registered: wait for both to show.
for _ in $(seq 100); do
  "$pith" cluster >"$out/cluster.txt" 2>&1
  [[ $(grep -c " $backend" "$out/cluster.txt") -ge 2 ]] && break
  sleep 0.2
done
[[ $(grep -c " $backend" "$out/cluster.txt") -ge 2 ]] ||
  fail "pith cluster shows no 2 $backend workers: $(cat "$out/cluster.txt")"
job=$("$pith" submit "$work/spec.json" 2>"$out/submit.err") || fail "submit: $(cat "$out/submit.err")"
timeout -k 5 "$(left)" "$pith" watch "$job" >"$out/watch.txt" 2>&1 ||
  fail "watch: $(tail -5 "$out/watch.txt"; tail -5 "$work"/local/worker0.log)"
grep -q "succeeded at step 20" "$out/watch.txt" || fail "job: $(tail -3 "$out/watch.txt")"
"$pith" checkpoint "$job" --out "$work/cluster.safetensors" >/dev/null || fail "checkpoint"

echo "== compare"
ce() { "$pith" eval --checkpoint "$1" --tokens "$work/tokens.bin" --batches 4 --spec "$work/spec.json" |
         sed -n 's/.* ce=\([0-9.e+-]*\).*/\1/p'; }
alone_ce=$(ce "$work/alone.safetensors")
cluster_ce=$(ce "$work/cluster.safetensors")
[[ -n $alone_ce && -n $cluster_ce ]] || fail "pith eval gave no ce (alone '$alone_ce', cluster '$cluster_ce')"
awk -v a="$alone_ce" -v c="$cluster_ce" -v b="$backend" 'BEGIN {
  d = (a - c) / a; if (d < 0) d = -d
  printf "SUMMARY: held-out ce: single process (cpu) %s, cluster (2 %s workers) %s, relative %.2e (want <= 1e-4)\n", a, b, c, d
  exit (a != "" && c != "" && d <= 1e-4) ? 0 : 1 }' || fail "the cluster's weights differ"
sed -e 's/"gpucluster"/"gpuclusterbf16"/' -e 's/"top_k": 2,/"top_k": 2, "compute_dtype": "bf16",/' \
  "$work/spec.json" >"$work/bf16.json"
if [[ $backend != cuda ]]; then  # no CUDA worker: refused at submit, with the reason
  if "$pith" submit "$work/bf16.json" 2>"$out/submit_bf16.err"; then fail "a bf16 job on $backend workers"; fi
  grep -q "bf16 trains on CUDA workers" "$out/submit_bf16.err" ||
    fail "bf16 submit: $(cat "$out/submit_bf16.err")"
  echo "SUMMARY: a bf16 job is refused without CUDA workers: $(cat "$out/submit_bf16.err")"
else
  echo "== the same job in bf16 on the GPU workers"
  job=$("$pith" submit "$work/bf16.json" 2>"$out/submit_bf16.err") ||
    fail "submit bf16: $(cat "$out/submit_bf16.err")"
  timeout -k 5 "$(left)" "$pith" watch "$job" >"$out/watch_bf16.txt" 2>&1 ||
    fail "watch bf16: $(tail -5 "$out/watch_bf16.txt")"
  "$pith" checkpoint "$job" --out "$work/bf16.safetensors" >/dev/null || fail "checkpoint bf16"
  bf16_ce=$(ce "$work/bf16.safetensors")
  [[ -n $bf16_ce ]] || fail "pith eval gave no ce for the bf16 job"
  awk -v a="$alone_ce" -v c="$bf16_ce" 'BEGIN {
    d = (a - c) / a; if (d < 0) d = -d
    printf "SUMMARY: held-out ce: bf16 cluster %s against fp32 single process %s, relative %.2e (want <= 2e-2)\n", c, a, d
    exit (c != "" && d <= 2e-2) ? 0 : 1 }' || fail "the bf16 job drifted from the fp32 one"
fi
# What the workers said they train on, and whether NCCL joined (two workers on one GPU:
# NCCL refuses the pair and the job's peer group carries their exchanges).
grep -h -m1 "training on" "$work"/local/worker*.log 2>/dev/null | head -2 | sed 's/^/SUMMARY: worker: /'
grep -h -m1 "device group" "$work"/local/worker*.log 2>/dev/null | head -2 | sed 's/^/SUMMARY: worker: /'
echo "SUMMARY: OK in $(($(date +%s) - start)) s"
