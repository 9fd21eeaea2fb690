#!/usr/bin/env bash
# Every GPU test and benchmark of Pith, on a machine with an NVIDIA GPU, in one command:
# builds the GPU-only tree (cmake -DPITH_GPU_ONLY=ON: the compute engine, the model, the
# CUDA backend, their tests and gpu_bench; Abseil and GoogleTest from .gpu-deps/, which
# tests/gpu/vendor.sh fills), runs its tests (the `gpu` ones, and the CPU backend's on the
# portable sgemm; the hand-written kernels' again under compute-sanitizer memcheck), then
# gpu_bench and, where python3 has a CUDA PyTorch, PyTorch's MoE layer on the same device
# (torch_moe_bench.py), then, where .gpu-cluster/ holds a bundle (cluster_bundle.sh), a
# local cluster with GPU workers (tests/gpu/cluster.sh), then racecheck with the time left
# (PITH_GPU_RACECHECK=0: not), and prints a summary: each stage's SUMMARY lines as it ends
# (a run cut off still shows them), all of them again at the end. Logs go to
# $OUT when it is set (the device tool brings them back), else to build-gpu/out. Exit
# status: 0 only when every test passed, gpu_bench ran, PyTorch's layer ran or python3 has
# no CUDA PyTorch, and the cluster agreed, had no bundle, or could not run the bundle here
# (no CUDA 13: cluster.sh's exit 3); the summary says what was skipped.
#
#   tests/gpu/vendor.sh                 # once, where Debian's archive is reachable
#   tests/gpu/cluster_bundle.sh build   # optional, where Pith builds with nvcc
#   tests/gpu/run.sh                    # on the GPU machine, from the repository root
# Each stage has a time limit (rc 124 when it ran out: a hung kernel; 137 when it did
# not stop within 30 s of that and was killed), so that one hang leaves the device call
# time for the rest and for the logs to come back; and no stage is given more than what
# is left of PITH_GPU_BUDGET_S (540 s, counted from the start, the build included: the
# device call's 600 s less the logs' way back; 0: no budget): a stage with under 10 s
# left is skipped (rc 124, "skipped: out of the run's ... s" in its log).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=${PITH_GPU_BUILD:-build-gpu}
out=${OUT:-$build/out}
mkdir -p "$out"
start=$(date +%s)
budget=${PITH_GPU_BUDGET_S:-540}
# Seconds a stage may run: its own limit, or what is left of the budget if less; 0 (skip
# it) under 10 s.
stage_limit() {
  ((budget > 0)) || { echo "$1"; return; }
  local left=$((start + budget - $(date +%s)))
  if ((left < 10)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}
# Runs "$@" under `timeout` with stage_limit's seconds for it (in STAGE_LIMIT_S too, for a
# stage that bounds its own waits; killed 30 s after it ran out); rc 124 when skipped.
limited() {
  local seconds
  seconds=$(stage_limit "$1")
  shift
  if ((seconds == 0)); then
    echo "skipped: out of the run's ${budget} s"
    return 124
  fi
  STAGE_LIMIT_S=$seconds timeout -k 30 "$seconds" "$@"
}
# A summary line printed as its stage ends (and kept in $out/summary.txt): a run cut off
# by the device call's own limit still shows what it had done.
said() { echo "SUMMARY: $*" | tee -a "$out/summary.txt"; }
: >"$out/summary.txt"

if [[ ! -f .gpu-deps/abseil-cpp/CMakeLists.txt || ! -f .gpu-deps/googletest/CMakeLists.txt ]]; then
  echo "run.sh: .gpu-deps/ is missing: run tests/gpu/vendor.sh first (and carry .gpu-deps)" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
  | tee "$out/gpu.txt" || echo "run.sh: nvidia-smi failed" >&2
# Which cuBLASLt versions this machine has, the toolkit's and PyTorch's wheel's: 13.1's
# (130100, the development machine's) has no grouped GEMM of its own; a newer one may.
python3 - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import ctypes, glob, os
libs = glob.glob("/usr/local/cuda/lib64/libcublasLt.so.*")
try:
    import nvidia.cublas
    for d in nvidia.cublas.__path__:
        libs += glob.glob(os.path.join(d, "lib", "libcublasLt.so.*"))
except ImportError:
    pass
for lib in sorted(set(libs)):
    try:
        lt = ctypes.CDLL(lib)
        lt.cublasLtGetVersion.restype = ctypes.c_size_t
        print("cublasLt", lt.cublasLtGetVersion(), lib)
    except OSError as e:
        print("cublasLt", lib, e)
PY
arch=${PITH_CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
  | head -1 | tr -d '. ')}
arch=${arch:-90}
# sm_90's warpgroup MMA (cuda_wgmma.cu) is in its arch-specific code only.
[[ $arch == 90 ]] && arch=90a
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# NCCL: beside the toolkit, else the one PyTorch's wheels bring.
nccl_root=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

echo "== build (sm_$arch, $(nproc) cores)"
if ! limited 120 cmake -S . -B "$build" "${generator[@]}" -DPITH_GPU_ONLY=ON \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DPITH_NCCL_ROOT="$nccl_root" >"$out/configure.log" 2>&1 ||
   ! limited 360 cmake --build "$build" -j "$(nproc)" >"$out/build.log" 2>&1; then
  tail -40 "$out/configure.log" "$out/build.log" 2>/dev/null
  said "build failed (or ran out of time) after $(($(date +%s) - start)) s"
  exit 1
fi
built=$(date +%s)
said "build $((built - start)) s"

echo "== tests (every test of the GPU-only build)"
limited 300 ctest --test-dir "$build" --output-on-failure 2>&1 | tee "$out/ctest.log"
tests_rc=${PIPESTATUS[0]}
grep -E "tests passed|tests failed" "$out/ctest.log" | while read -r line; do said "$line"; done
grep -E '^[[:space:]]*[0-9]+ - .*\((Failed|Timeout|Not Run)\)' "$out/ctest.log" |
  while read -r line; do said "failed: $line"; done
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# The hand-written kernels' own checks once more under compute-sanitizer (the cuBLAS
# ones are left out). Its verdict is its error count: a numeric mismatch is the tests'.
#   sanitize TOOL SECONDS: "clean", "N errors", or "timed out or skipped"
sanitize() {
  local tool=$1 seconds=$2
  if [[ ! -x $sanitizer ]]; then
    said "compute-sanitizer $tool: not found, skipped"
    return 0
  fi
  limited "$seconds" "$sanitizer" --tool "$tool" "$build/grouped_gemm_test" \
    --gtest_filter='GroupedGemmTest.Every*:GroupedGemmTest.TheIdentity*:GroupedGemmTest.Epilogues*' \
    >"$out/sanitizer-$tool.log" 2>&1
  local rc=$? errors
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+" "$out/sanitizer-$tool.log" | tail -1 | grep -oE "[0-9]+$")
  if ((rc == 124 || rc == 137)); then  # slow under the tool, or out of the budget
    said "compute-sanitizer $tool: timed out or skipped (rc $rc), not counted"
  elif [[ -z $errors ]]; then  # it did not run (a launch failure, a driver it cannot use)
    said "compute-sanitizer $tool: no ERROR SUMMARY (rc $rc; sanitizer-$tool.log)"
    tail -5 "$out/sanitizer-$tool.log"
    return 1
  elif ((errors == 0)); then
    said "compute-sanitizer $tool: clean"
  else
    said "compute-sanitizer $tool: $errors errors (sanitizer-$tool.log)"
    grep -m 5 -A 4 "^=========.*\(Invalid\|Race\|Hazard\)" "$out/sanitizer-$tool.log"
    return 1
  fi
}
# Out-of-bounds accesses fail the run; shared-memory races (racecheck: slow on the deep
# cp.async pipelines) are looked for last, with what time is left, reported only.
sanitize memcheck 120 || tests_rc=1
tested=$(date +%s)
said "tests $((tested - built)) s (rc $tests_rc)"

echo "== gpu_bench"
limited 240 "$build/gpu_bench" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
grep -E "^(expert_|moe_layer)" "$out/bench.log" | while read -r line; do said "$line"; done
said "gpu_bench rc $bench_rc after $(($(date +%s) - start)) s"
echo "== torch_moe_bench (PyTorch's MoE layer on this device: the anchor of moe_layer)"
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PYTHONUNBUFFERED=1 limited 150 python3 tests/gpu/torch_moe_bench.py 2>&1 | tee "$out/torch.log"
  torch_rc=${PIPESTATUS[0]}
  said "torch_moe_bench rc $torch_rc after $(($(date +%s) - start)) s"
else
  echo "torch_moe_bench skipped: python3 has no PyTorch that sees this GPU" | tee "$out/torch.log"
  torch_rc=0
fi
echo "== cluster (tests/gpu/cluster.sh: a local cluster with GPU workers, from the bundle)"
if [[ -f .gpu-cluster/pith-cluster.tar.gz ]]; then
  OUT=$out/cluster limited 200 bash -c 'PITH_CLUSTER_LIMIT_S=$STAGE_LIMIT_S exec bash tests/gpu/cluster.sh' \
    2>&1 | tee "$out/cluster.log"
  cluster_rc=${PIPESTATUS[0]}
  # 3: this machine cannot run the bundle (no CUDA 13 libraries, an older driver): said
  # in its summary line, not a failure of Pith's.
  ((cluster_rc == 3)) && cluster_rc=0
  grep -E "^SUMMARY" "$out/cluster.log" | sed 's/^SUMMARY: //' | while read -r line; do
    said "cluster: $line"
  done
else
  echo "cluster skipped: no .gpu-cluster/pith-cluster.tar.gz (tests/gpu/cluster_bundle.sh)" |
    tee "$out/cluster.log"
  said "cluster: skipped, no bundle"
  cluster_rc=0
fi
end=$(date +%s)

# Pith's fp32 layer against PyTorch's fp32 loop (the same precision); Pith's bf16 layer
# against PyTorch's best (bf16 torch._grouped_mm where it exists).
for shape in qwen3-30b-a3b deepseek-v2-lite; do
  awk -v s="$shape" '
    $1 == "moe_layer" && $2 == s {
      for (i = 1; i <= NF; ++i) if ($i == "ms") t = $(i - 1)
      if ($4 == "fp32") pith32 = t
      if ($4 == "bf16") pith16 = t
      if ($4 == "bf16_blobs") blobs = t
      if ($4 == "bf16_kernel") kern = t
      if ($4 == "bf16_batched") batched = t
      if ($4 ~ /^bf16_wgmma/ && (wgmma == "" || t + 0 < wgmma + 0)) { wgmma = t; wgmma_tile = $4 }
    }
    $1 == "torch_moe" && $2 == s && $5 == "ms" {
      if ($3 == "loop_fp32") fp32 = $4
      if (best == "" || $4 < best) { best = $4; variant = $3 }
    }
    END {
      if (pith16 == "" || best == "") {
        print "moe_layer_vs_torch " s ": missing a figure (Pith bf16 or PyTorch)"; exit
      }
      printf "moe_layer_vs_torch %s ", s
      if (pith32 != "" && fp32 != "") {
        printf "pith fp32 %.2f ms vs torch loop_fp32 %.2f ms (x%.2f); ", pith32, fp32, fp32 / pith32
      }
      printf "pith bf16 %.2f ms vs torch best %s %.2f ms (x%.2f; target >= 1.5)", pith16,
             variant, best, best / pith16
      if (blobs != "") printf "; from bf16 weights blobs (a cluster worker) %.2f ms (x%.2f)", \
                              blobs, best / blobs
      if (batched != "") printf "; products as batched calls %.2f ms (x%.2f)", \
                                batched, best / batched
      if (kern != "") printf "; products through the grouped kernel %.2f ms (x%.2f)", \
                             kern, best / kern
      if (wgmma != "") printf "; through %s %.2f ms (x%.2f)", wgmma_tile, wgmma, best / wgmma
      printf "\n"
    }' "$out/bench.log" "$out/torch.log" | tee -a "$out/torch.log"
done

said "total: build $((built - start)) s, tests $((tested - built)) s (rc $tests_rc), bench" \
     "$((end - tested)) s (rc $bench_rc; torch rc $torch_rc, cluster rc $cluster_rc; 124: out" \
     "of time), all $(($(date +%s) - start)) s"
# ptxas' word when it had to serialize the wgmma kernel's MMAs (right, but slow).
grep -E "wgmma.*serialized|C75[0-9][0-9]" "$out/build.log" | sort -u | head -3 |
  while read -r line; do said "$line"; done
# gpu_bench's own words: its errors, and warnings such as a refused batched call (then a
# bf16_batched figure is the fan-out's).
grep -vE "^(expert_|moe_layer|gpu_bench on)" "$out/bench.log" | head -20 |
  while read -r line; do said "bench: $line"; done
grep -E "^moe_layer_vs_torch|failed|unavailable|skipped" "$out/torch.log" |
  while read -r line; do said "$line"; done
# Last: nothing after it is lost when the device call's limit cuts it short.
[[ ${PITH_GPU_RACECHECK:-1} != 0 ]] && { sanitize racecheck 90 || true; }
echo "== summary (also in summary.txt)"
cat "$out/summary.txt"
[[ $tests_rc == 0 && $bench_rc == 0 && $torch_rc == 0 && $cluster_rc == 0 ]]
