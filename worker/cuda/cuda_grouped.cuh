// The parts of Pith's grouped bf16 kernels (CudaBackend::KernelGemmBf16) that the two
// kernels share: the problem table, cp.async, the search for a tile's problem and the
// epilogue that stores a pair of accumulators. cuda_grouped.cu holds the mma.sync kernel
// (sm_80 and later), cuda_wgmma.cu the warpgroup-MMA one (sm_90a). Internal to worker/cuda.
#ifndef PITH_WORKER_CUDA_CUDA_GROUPED_CUH_
#define PITH_WORKER_CUDA_CUDA_GROUPED_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda::grouped {

// kPlain: beta 0 and no epilogue, so a fragment's store is alpha acc and nothing more.
enum Flags : int { kTransA = 1, kTransB = 2, kOutFp32 = 4, kPairs = 8, kPlain = 16 };

// One problem as the kernel reads it. Row-major C[m, n] = alpha op(A) op(B) + beta C.
struct KernelProblem {
  const __nv_bfloat16* a;
  const __nv_bfloat16* b;
  void* c;
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  int flags;
  int tiles_n;
  int64_t first_tile;  // tiles of the problems before it
  // CudaBackend::Epilogue, with C's leading dimension.
  const float* bias;
  const float* gelu_grad_of;
  __nv_bfloat16* c_bf16;
  float* gelu_out;
  __nv_bfloat16* gelu_bf16;
};

__device__ __forceinline__ void CpAsync16(void* shared, const void* global, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The problem that grouped tile `tile` belongs to: the last whose first tile is <= tile.
__device__ __forceinline__ int FindProblem(const KernelProblem* __restrict__ problems, int count,
                                           int64_t tile) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (problems[mid].first_tile <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// This CTA's tile: finds its problem and calls run(problem, the tile's index within it,
// std::bool_constant<trans_a>, std::bool_constant<trans_b>), so that a kernel's tile code
// is compiled once per pair of transposes.
template <typename F>
__device__ __forceinline__ void RunThisTile(const KernelProblem* __restrict__ problems, int count,
                                            F&& run) {
  const int64_t tile = blockIdx.x;
  const KernelProblem p = problems[FindProblem(problems, count, tile)];
  const int64_t local = tile - p.first_tile;
  switch (p.flags & (kTransA | kTransB)) {
    case 0:
      run(p, local, std::false_type{}, std::false_type{});
      break;
    case kTransA:
      run(p, local, std::true_type{}, std::false_type{});
      break;
    case kTransB:
      run(p, local, std::false_type{}, std::true_type{});
      break;
    default:
      run(p, local, std::true_type{}, std::true_type{});
      break;
  }
}

// CTAs of `kernel` (with `threads` threads and `smem` bytes of dynamic shared memory) that
// fit on one SM of the current device at once; 0 after an error, which it clears (a query's
// failure leaves the device usable).
inline int KernelBlocksPerSm(const void* kernel, int threads, int smem) {
  int blocks = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

// The epilogue of CudaBackend::Epilogue on v = alpha acc + beta C at (row, col), and col + 1
// when `pair` (then each access is one 8-byte (fp32) or 4-byte (bf16) one). C is not read
// with beta 0. The order and precision of each operation are the element-wise kernels'
// (BiasGeluKernel, SegmentBiasKernel, GeluBackwardInPlaceKernel, ToBf16).
__device__ __forceinline__ void StorePair(const KernelProblem& p, int row, int col, float v0,
                                          float v1, bool pair) {
  const int64_t at = int64_t{row} * p.ldc + col;
  v0 *= p.alpha;
  v1 *= p.alpha;
  if (!(p.flags & kOutFp32)) {
    __nv_bfloat16* c = static_cast<__nv_bfloat16*>(p.c) + at;
    if (pair) {
      if (p.beta != 0.0f) {
        const float2 old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(c));
        v0 += p.beta * old.x;
        v1 += p.beta * old.y;
      }
      *reinterpret_cast<__nv_bfloat162*>(c) = __floats2bfloat162_rn(v0, v1);
    } else {
      if (p.beta != 0.0f) v0 += p.beta * __bfloat162float(c[0]);
      c[0] = __float2bfloat16_rn(v0);
    }
    return;
  }
  float* c = static_cast<float*>(p.c) + at;
  // Two fp32 values at `q`, one 8-byte load for a pair.
  auto load2 = [pair](const float* q) {
    return pair ? *reinterpret_cast<const float2*>(q) : make_float2(q[0], 0.0f);
  };
  if (p.beta != 0.0f) {
    const float2 old = load2(c);
    v0 += p.beta * old.x;
    v1 += p.beta * old.y;
  }
  if (p.bias != nullptr) {
    v0 += p.bias[col];
    if (pair) v1 += p.bias[col + 1];
  }
  if (p.gelu_grad_of != nullptr) {
    const float2 pre = load2(p.gelu_grad_of + at);
    v0 *= GeluTanhGrad(pre.x);
    if (pair) v1 *= GeluTanhGrad(pre.y);
  }
  if (pair) {
    *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
  } else {
    c[0] = v0;
  }
  if (p.c_bf16 != nullptr) {
    if (pair) {
      *reinterpret_cast<__nv_bfloat162*>(p.c_bf16 + at) = __floats2bfloat162_rn(v0, v1);
    } else {
      p.c_bf16[at] = __float2bfloat16_rn(v0);
    }
  }
  if (p.gelu_out != nullptr || p.gelu_bf16 != nullptr) {
    const float g0 = GeluTanh(v0), g1 = pair ? GeluTanh(v1) : 0.0f;
    if (p.gelu_out != nullptr) {
      if (pair) {
        *reinterpret_cast<float2*>(p.gelu_out + at) = make_float2(g0, g1);
      } else {
        p.gelu_out[at] = g0;
      }
    }
    if (p.gelu_bf16 != nullptr) {
      if (pair) {
        *reinterpret_cast<__nv_bfloat162*>(p.gelu_bf16 + at) = __floats2bfloat162_rn(g0, g1);
      } else {
        p.gelu_bf16[at] = __float2bfloat16_rn(g0);
      }
    }
  }
}

// StoreFragment's general case: each column through StorePair. Not inlined: a tile's 64
// fragments share one copy of it (inlined, the epilogue's every branch made each kernel's
// code megabytes, streamed past the instruction cache once per tile).
static __device__ __noinline__ void StoreFragmentGeneral(const KernelProblem& p, int row, int col,
                                                         float v0, float v1) {
  if (col + 1 < p.n && (p.flags & kPairs)) {
    StorePair(p, row, col, v0, v1, true);
  } else {
    StorePair(p, row, col, v0, 0.0f, false);
    if (col + 1 < p.n) StorePair(p, row, col + 1, v1, 0.0f, false);
  }
}

// The accumulators (v0, v1) of C[row][col, col + 1] (col even; rows and columns past C's
// are dropped). A pair is stored whole where C's rows keep it aligned (kPairs: ldc even and
// C aligned, checked on the host); a plain pair (kPlain) in a few instructions here, as
// StorePair would store it.
__device__ __forceinline__ void StoreFragment(const KernelProblem& p, int row, int col, float v0,
                                              float v1) {
  if (row >= p.m || col >= p.n) return;
  if ((p.flags & (kPlain | kPairs)) == (kPlain | kPairs) && col + 1 < p.n) {
    const int64_t at = int64_t{row} * p.ldc + col;
    if (p.flags & kOutFp32) {
      *reinterpret_cast<float2*>(static_cast<float*>(p.c) + at) =
          make_float2(v0 * p.alpha, v1 * p.alpha);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.c) + at) =
          __floats2bfloat162_rn(v0 * p.alpha, v1 * p.alpha);
    }
    return;
  }
  StoreFragmentGeneral(p, row, col, v0, v1);
}

}  // namespace pith::cuda::grouped

#endif  // PITH_WORKER_CUDA_CUDA_GROUPED_CUH_
