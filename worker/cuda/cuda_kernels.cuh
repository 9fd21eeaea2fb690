// Device helpers shared by the CUDA backend's translation units: launch shapes, block
// reductions and the gelu of DESIGN §3. Internal to worker/cuda.
#ifndef PITH_WORKER_CUDA_CUDA_KERNELS_CUH_
#define PITH_WORKER_CUDA_CUDA_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

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

__device__ __forceinline__ float GeluTanh(float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  return 0.5f * v * (1.0f + tanhf(u));
}

__device__ __forceinline__ float GeluTanhGrad(float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  const float t = tanhf(u);
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
