// CudaBackend::KernelGemmBf16 on sm_90a: the grouped bf16 product with the warpgroup MMA
// (wgmma) that mma.sync leaves unused on sm_90 (cuda_grouped.cu holds the mma.sync kernel,
// cuda_grouped.cuh what the two share: the problem table, the tile search, the epilogue).
//
// One CTA of two warpgroups per 128 x 128 (or 128 x 256) output tile of any problem, each
// warpgroup 64 rows of it; k in steps of 64 through a cp.async pipeline of kStages stages
// in shared memory. Each operand's stage is stored as wgmma reads it without a transpose
// of ours, K-major or MN-major as the operand lies in memory (wgmma_layout.h, checked
// against the PTX ISA's canonical layouts by wgmma_layout_test); the instruction's
// transpose bit says which.
// The pipeline: a stage's copies are waited for, fenced into the async proxy (wgmma reads
// shared memory through it) and barriered; the warpgroups issue its k16 MMAs (four per
// 128 columns) and then
// wait for the previous stage's, so that after the next barrier the stage two back is free
// and is refilled: kStages - 2 stages load while one computes and one may still be read.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_grouped.cuh"
#include "worker/cuda/wgmma_layout.h"

// wgmma and the async-proxy fence exist only in sm_90a code; elsewhere the kernel is an
// empty stub that the host never launches (KernelTileRuns asks the probe).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PITH_WGMMA 1
#else
#define PITH_WGMMA 0
#endif

namespace pith::cuda {
namespace {

using namespace grouped;  // NOLINT: the kernels' shared parts

cudaStream_t S(CUstream_st* s) { return s; }

using wgmma::kAtom;
constexpr int kBk = wgmma::kStageK;

template <int kBnT, int kStagesT>
struct WgTile {
  static constexpr int kBm = 128, kBn = kBnT, kStages = kStagesT;
  static constexpr int kHalves = kBn / 128;  // m64n128k16 MMAs per k16 slice and warpgroup
  static constexpr int kThreads = 256;       // two warpgroups: rows 0-63 and 64-127
  static constexpr int kABytes = kBm * kBk * 2, kBBytes = kBn * kBk * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kSharedBytes = kStages * kStageBytes + kAtom;  // + alignment slack
  static_assert(kStages >= 3, "one stage loading, one computing, one still read");
  static_assert(kHalves * 128 == kBn, "whole m64n128 MMAs");
};
using Wg128x128 = WgTile<128, 5>;  // 161 KiB of shared memory
using Wg128x256 = WgTile<256, 4>;  // 193 KiB

#if PITH_WGMMA
using wgmma::kKGroups;

// K-major rows [r0, r0 + kRows) x k [k0, k0 + 64) of a row-major [max_r][max_k] matrix.
template <int kRows, int kThreads>
__device__ __forceinline__ void LoadKMajor(unsigned char* smem, const __nv_bfloat16* g, int ld,
                                           int r0, int k0, int max_r, int max_k) {
  constexpr int kChunks = kRows * kKGroups;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int r = chunk / kKGroups, c = chunk % kKGroups;
    const bool valid = r0 + r < max_r && k0 + c * 8 < max_k;
    const __nv_bfloat16* src = valid ? g + int64_t{r0 + r} * ld + (k0 + c * 8) : g;
    CpAsync16(smem + wgmma::KMajorOffset(r, c * 8), src, valid);
  }
}

// MN-major k rows [k0, k0 + 64) x columns [c0, c0 + kCols) of a row-major [max_k][max_c]
// matrix.
template <int kCols, int kThreads>
__device__ __forceinline__ void LoadMnMajor(unsigned char* smem, const __nv_bfloat16* g, int ld,
                                            int k0, int c0, int max_k, int max_c) {
  constexpr int kPerRow = kCols / 8;
  constexpr int kChunks = kBk * kPerRow;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int k = chunk / kPerRow, c = chunk % kPerRow;
    const bool valid = k0 + k < max_k && c0 + c * 8 < max_c;
    const __nv_bfloat16* src = valid ? g + int64_t{k0 + k} * ld + (c0 + c * 8) : g;
    CpAsync16(smem + wgmma::MnMajorOffset(c * 8, k), src, valid);
  }
}

template <typename T, bool kTa, bool kTb>
__device__ __forceinline__ void LoadStage(unsigned char* stage, const KernelProblem& p, int m0,
                                          int n0, int k0) {
  if (kTa) {  // A stored [k][m]
    LoadMnMajor<T::kBm, T::kThreads>(stage, p.a, p.lda, k0, m0, p.k, p.m);
  } else {  // A stored [m][k]
    LoadKMajor<T::kBm, T::kThreads>(stage, p.a, p.lda, m0, k0, p.m, p.k);
  }
  if (kTb) {  // B stored [n][k]
    LoadKMajor<T::kBn, T::kThreads>(stage + T::kABytes, p.b, p.ldb, n0, k0, p.n, p.k);
  } else {  // B stored [k][n]
    LoadMnMajor<T::kBn, T::kThreads>(stage + T::kABytes, p.b, p.ldb, k0, n0, p.k, p.n);
  }
}

// The descriptor of an operand's rows (m of A, n of B) from `first` on, k16 slice kk, in a
// stage at `tile` (wgmma_layout.h).
template <bool kMnMajor>
__device__ __forceinline__ uint64_t OperandDescriptor(const unsigned char* tile, int first,
                                                      int kk) {
  const wgmma::DescriptorParts d = wgmma::OperandDescriptor(kMnMajor, first, kk);
  return wgmma::Descriptor(static_cast<uint32_t>(__cvta_generic_to_shared(tile + d.start)), d);
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's shared-memory writes (its cp.async copies) visible to wgmma.
__device__ __forceinline__ void FenceAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of the accumulators across a wgmma fence or wait.
template <int N>
__device__ __forceinline__ void FenceAccumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 rows x 128 columns, fp32) += A (64 x 16) B (16 x 128), both from shared memory;
// kTransA / kTransB: the operand is MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void Wgmma64x128(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(a), "l"(b), "r"(1), "n"(kTransA), "n"(kTransB));
}

template <typename T, bool kTa, bool kTb>
__device__ __forceinline__ void RunTile(const KernelProblem& p, int64_t tile, unsigned char* smem) {
  const int m0 = static_cast<int>(tile / p.tiles_n) * T::kBm;
  const int n0 = static_cast<int>(tile % p.tiles_n) * T::kBn;
  const int wg = threadIdx.x / 128;
  float acc[T::kHalves][64];
#pragma unroll
  for (int h = 0; h < T::kHalves; ++h) {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    FenceAccumulators(acc[h]);
  }
  const int steps = (p.k + kBk - 1) / kBk;
  constexpr int kStages = T::kStages;
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < steps) LoadStage<T, kTa, kTb>(smem + s * T::kStageBytes, p, m0, n0, s * kBk);
    CpAsyncCommit();  // empty groups keep the count uniform
  }
  for (int step = 0; step < steps; ++step) {
    CpAsyncWait<kStages - 3>();  // step's group has landed (for this thread)
    FenceAsyncShared();
    __syncthreads();  // for every thread; and each warpgroup's MMAs of step - 2 are done
    const int next = step + kStages - 2;
    if (next < steps) {
      LoadStage<T, kTa, kTb>(smem + (next % kStages) * T::kStageBytes, p, m0, n0, next * kBk);
    }
    CpAsyncCommit();
    const unsigned char* stage = smem + (step % kStages) * T::kStageBytes;
#pragma unroll
    for (int h = 0; h < T::kHalves; ++h) FenceAccumulators(acc[h]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      const uint64_t a = OperandDescriptor<kTa>(stage, wg * 64, kk);
#pragma unroll
      for (int h = 0; h < T::kHalves; ++h) {
        Wgmma64x128<kTa ? 1 : 0, kTb ? 0 : 1>(
            acc[h], a, OperandDescriptor<!kTb>(stage + T::kABytes, h * 128, kk));
      }
    }
    WgmmaCommit();
    WgmmaWait<1>();  // this warpgroup's MMAs of step - 1 are done
#pragma unroll
    for (int h = 0; h < T::kHalves; ++h) FenceAccumulators(acc[h]);
  }
  WgmmaWait<0>();
  CpAsyncWait<0>();
  // The accumulators as mma.sync's m16n8 blocks: warp w of the warpgroup holds rows
  // [16w, 16w + 16), acc[h][4j + e] the n8 block j of half h (rows g and g + 8).
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row = m0 + wg * 64 + warp * 16 + g;
#pragma unroll
  for (int h = 0; h < T::kHalves; ++h) {
    FenceAccumulators(acc[h]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = n0 + h * 128 + j * 8 + 2 * t;
      StoreFragment(p, row, col, acc[h][4 * j], acc[h][4 * j + 1]);
      StoreFragment(p, row + 8, col, acc[h][4 * j + 2], acc[h][4 * j + 3]);
    }
  }
}
#endif  // PITH_WGMMA

template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    WgmmaGemmKernel(const KernelProblem* __restrict__ problems, int count) {
#if PITH_WGMMA
  // Declared with 16-byte alignment only, so that the compiler cannot assume the 1024 the
  // code below makes sure of.
  extern __shared__ __align__(16) unsigned char shared_raw[];
  // The swizzle works on address bits: atoms must start 1024-byte aligned, which the
  // dynamic window does not promise.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(shared_raw));
  unsigned char* smem = shared_raw + (kAtom - raw % kAtom) % kAtom;
  RunThisTile(problems, count, [&](const KernelProblem& p, int64_t local, auto ta, auto tb) {
    RunTile<T, decltype(ta)::value, decltype(tb)::value>(p, local, smem);
  });
#endif
}

// 1 where this device runs the build's sm_90a code, 0 where it runs other code.
__global__ void WgmmaProbe(int* out) { *out = PITH_WGMMA; }

template <typename T>
const void* KernelOf() {
  return reinterpret_cast<const void*>(WgmmaGemmKernel<T>);
}

}  // namespace

int CudaBackend::WgmmaSharedBytes(KernelTile tile) {
  return tile == KernelTile::kWgmma128x256 ? Wg128x256::kSharedBytes : Wg128x128::kSharedBytes;
}

int CudaBackend::ProbeWgmma() {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_) != cudaSuccess) {
    cudaGetLastError();  // the query's failure is not the backend's
    return -1;
  }
  if (major != 9 || minor != 0) return 0;
  int* flag = nullptr;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) {  // no memory for the flag now
    cudaGetLastError();
    return -1;
  }
  int runs = 0;
  WgmmaProbe<<<1, 1, 0, S(stream_)>>>(flag);
  const cudaError_t launched = cudaGetLastError();
  if (launched == cudaErrorNoKernelImageForDevice || launched == cudaErrorInvalidDeviceFunction) {
    cudaFree(flag);
    return 0;  // no code for this device in the build at all
  }
  // Anything else is the backend's (an earlier kernel's error may surface here): kept.
  const bool ran =
      CheckCuda(launched, "wgmma probe") &&
      CheckCuda(cudaMemcpyAsync(&runs, flag, sizeof(int), cudaMemcpyDeviceToHost, S(stream_)),
                "wgmma probe") &&
      CheckCuda(cudaStreamSynchronize(S(stream_)), "wgmma probe");
  cudaFree(flag);
  if (!ran) return -1;
  return runs == 1 ? 1 : 0;
}

int CudaBackend::WgmmaBlocksPerSm(KernelTile tile) {
  const bool wide = tile == KernelTile::kWgmma128x256;
  const void* kernel = wide ? KernelOf<Wg128x256>() : KernelOf<Wg128x128>();
  const int smem = WgmmaSharedBytes(tile);
  return grouped::KernelBlocksPerSm(kernel, Wg128x128::kThreads, smem);
}

bool CudaBackend::LaunchWgmma(const std::vector<Bf16Gemm>& problems, const char* op) {
  const bool wide = kernel_tile_ == KernelTile::kWgmma128x256;
  const int smem = WgmmaSharedBytes(kernel_tile_);
  if (!SetKernelSmem(wide ? KernelOf<Wg128x256>() : KernelOf<Wg128x128>(), smem)) return false;
  const KernelTable table =
      UploadKernelTable(problems, 128, wide ? Wg128x256::kBn : Wg128x128::kBn, op);
  if (table.count == 0) return true;
  const auto* t = static_cast<const KernelProblem*>(table.problems);
  const auto tiles = static_cast<unsigned>(table.tiles);
  if (wide) {
    WgmmaGemmKernel<Wg128x256><<<tiles, Wg128x256::kThreads, smem, S(stream_)>>>(t, table.count);
  } else {
    WgmmaGemmKernel<Wg128x128><<<tiles, Wg128x128::kThreads, smem, S(stream_)>>>(t, table.count);
  }
  CountKernelLaunch(problems, op);
  return true;
}

}  // namespace pith::cuda
