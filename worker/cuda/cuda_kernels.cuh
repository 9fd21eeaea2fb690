// Helpers shared by the CUDA backend's translation units: launch shapes, block reductions,
// the gelu of DESIGN §3 and the host-side arrays of a cuBLAS grouped product. Internal to
// worker/cuda.
#ifndef PITH_WORKER_CUDA_CUDA_KERNELS_CUH_
#define PITH_WORKER_CUDA_CUDA_KERNELS_CUH_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace pith::cuda {

inline constexpr int kThreads = 256;  // threads per block of every kernel here

// Blocks for a grid-stride loop over n elements (capped: the loop covers the rest).
inline int GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

#define PITH_GRID_STRIDE(i, n)                                              \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t{blockDim.x} * gridDim.x)

// The host-side arrays of a cuBLAS grouped product, one problem per group: column-major,
// the operands swapped as CudaBackend::Gemm swaps them (row-major C = op(A) op(B) is
// column-major C^T = op(B)^T op(A)^T). P has trans_a, trans_b, m, n, k, a, lda, b, ldb,
// alpha, beta, c and ldc; `pointers` holds every B, then every A, then every C.
template <typename P>
struct GroupedArrays {
  explicit GroupedArrays(const std::vector<P>& problems)
      : count(static_cast<int>(problems.size())),
        ta(count),
        tb(count),
        m(count),
        n(count),
        k(count),
        lda(count),
        ldb(count),
        ldc(count),
        size(count, 1),
        alpha(count),
        beta(count),
        pointers(3 * problems.size()) {
    for (int i = 0; i < count; ++i) {
      const P& p = problems[i];
      ta[i] = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      tb[i] = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      m[i] = p.n;
      n[i] = p.m;
      k[i] = p.k;
      lda[i] = p.ldb;
      ldb[i] = p.lda;
      ldc[i] = p.ldc;
      alpha[i] = p.alpha;
      beta[i] = p.beta;
      pointers[i] = p.b;
      pointers[count + i] = p.a;
      pointers[2 * count + i] = p.c;
    }
  }
  int count;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  std::vector<const void*> pointers;
};

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ T WarpMax(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  return v;
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// it. `shared` holds 32 values. The block must reach it together.
template <typename T>
__device__ T BlockSum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? shared[lane] : T(0);
  if (warp == 0) v = WarpSum(v);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  const T total = shared[0];
  __syncthreads();
  return total;
}

template <typename T>
__device__ T BlockMax(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpMax(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? shared[lane] : shared[0];
    v = WarpMax(v);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const T total = shared[0];
  __syncthreads();
  return total;
}

inline constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluCubic = 0.044715f;

// tanh(u) = 1 - 2 / (exp(2u) + 1), as the CPU backend computes it. GELU's derivative takes
// 1 - tanh^2, which cancels near |tanh| = 1: two tanh routines an ulp apart there give
// derivatives 1e-4 apart (relative), so the GPU forms tanh exactly as the CPU does; the
// two exp routines then differ far below the rounding of the final subtraction.
__device__ __forceinline__ float TanhLikeCpu(float u) {
  return 1.0f - 2.0f / (expf(2.0f * u) + 1.0f);
}

__device__ __forceinline__ float GeluTanh(float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  return 0.5f * v * (1.0f + TanhLikeCpu(u));
}

__device__ __forceinline__ float GeluTanhGrad(float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  const float t = TanhLikeCpu(u);
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
}

// Column sums of rows [row_begin, row_end) of a [*, n] matrix, added to out[n]: blocks of
// (32 columns x 8 row lanes), launched with dim3(32, 8) threads and ceil(n / 32) blocks in x.
__device__ __forceinline__ void ColumnSumInto(float* out, const float* in, int64_t row_begin,
                                              int64_t row_end, int n) {
  __shared__ float partial[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float sum = 0.0f;
  if (col < n) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += 8) sum += in[r * n + col];
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float total = 0.0f;
    for (int i = 0; i < 8; ++i) total += partial[i][threadIdx.x];
    out[col] += total;
  }
}

}  // namespace pith::cuda

#endif  // PITH_WORKER_CUDA_CUDA_KERNELS_CUH_
