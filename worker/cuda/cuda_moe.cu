// CudaBackend: routing, token permutation, the grouped expert FFN and the router backward.
//
// Route computes the softmax, the top-k and the bucket layout on the device, exactly as
// the CPU backend does, and copies back only what the host needs (the offsets size the
// grouped products). Permutation and combination move whole rows, one warp per row, in
// float4 where the rows allow. The expert FFN is two grouped products forward and two
// backward over the non-empty buckets, with the bias, gelu and bias-gradient kernels
// addressing the buckets through a small segment table.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

cudaStream_t S(CUstream_st* s) { return s; }

int WarpBlocks(int64_t warps) {
  return static_cast<int>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// Blocks for a loop of warps over rows (capped: the loop covers the rest).
int RowBlocks(int64_t rows) { return std::clamp(WarpBlocks(rows), 1, 1 << 20); }

// Whether rows of `channels` floats at these addresses can move as float4.
bool ByFloat4(int channels, std::initializer_list<const void*> rows) {
  if (channels % 4 != 0) return false;
  for (const void* p : rows) {
    if (reinterpret_cast<uintptr_t>(p) % alignof(float4) != 0) return false;
  }
  return true;
}

template <typename V, typename T>
V* As(T* p) {
  return reinterpret_cast<V*>(p);
}
template <typename V, typename T>
const V* As(const T* p) {
  return reinterpret_cast<const V*>(p);
}

// The top-k's order key: a probability, or -1 for NaN (a token's probabilities are NaN
// all together or not at all), so that NaN ties and the lower id wins, as on the CPU.
__device__ __forceinline__ float TopKey(float p) { return isnan(p) ? -1.0f : p; }

// One warp per token: softmax (in double, as the CPU backend), logsumexp, and the top-k
// by probability (ties: the lower id), renormalized if asked. Any expert beats none, so a
// token whose probabilities are NaN still gets k valid experts: the CPU's, 0 to k - 1.
__global__ void RouteKernel(const float* logits, int n, int experts, int top_k, bool renormalize,
                            float* probs, float* lse, int32_t* expert, float* gate) {
  const int64_t t = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  const float* r = logits + t * experts;
  float* p = probs + t * experts;
  float mx = -INFINITY;
  for (int e = lane; e < experts; e += 32) mx = fmaxf(mx, r[e]);
  mx = WarpMax(mx);
  double sum = 0;
  for (int e = lane; e < experts; e += 32) sum += exp(double{r[e]} - mx);
  const double l = mx + log(WarpSum(sum));
  for (int e = lane; e < experts; e += 32) p[e] = static_cast<float>(exp(double{r[e]} - l));
  if (lane == 0) lse[t] = static_cast<float>(l);
  __syncwarp();
  int32_t* chosen = expert + t * top_k;
  float* g = gate + t * top_k;
  double gate_sum = 0;
  for (int s = 0; s < top_k; ++s) {
    float best_p = -1.0f;
    int best = experts;
    for (int e = lane; e < experts; e += 32) {
      bool taken = false;
      for (int j = 0; j < s; ++j) taken |= chosen[j] == e;
      const float key = TopKey(p[e]), best_key = TopKey(best_p);
      if (!taken && (best == experts || key > best_key || (key == best_key && e < best))) {
        best_p = p[e];
        best = e;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, best_p, offset);
      const int oe = __shfl_xor_sync(0xffffffffu, best, offset);
      const float key = TopKey(op), best_key = TopKey(best_p);
      if (oe != experts && (best == experts || key > best_key || (key == best_key && oe < best))) {
        best_p = op;
        best = oe;
      }
    }
    if (lane == 0) {
      chosen[s] = best;
      g[s] = best_p;
    }
    gate_sum += best_p;
    __syncwarp();
  }
  if (renormalize) {
    for (int s = lane; s < top_k; s += 32) g[s] = static_cast<float>(g[s] / gate_sum);
  }
}

// prob_sum[e] = sum over tokens of probs[:, e], in double; one block per expert.
__global__ void ProbSumKernel(double* out, const float* probs, int n, int experts) {
  __shared__ double shared[32];
  double sum = 0;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) sum += probs[t * experts + blockIdx.x];
  sum = BlockSum(sum, shared);
  if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

// The bucket layout, in three passes over the assignments in slot-major order (slot 0 of
// every token first, the order in which capacity keeps them), cut into tiles of
// kRouteTile: count each tile's assignments per expert; turn the counts into each tile's
// first rank per expert, and the ranks into offsets; place each assignment at its rank,
// a warp per tile keeping the order within it.
constexpr int kRouteTile = 1024;

__device__ __forceinline__ int SlotMajorExpert(const int32_t* expert, int64_t i, int n, int k,
                                               int64_t* a) {
  *a = (i % n) * k + i / n;
  return expert[*a];
}

// counts[tile][e] += the tile's assignments to expert e (counts zeroed before).
__global__ void RouteCountKernel(int32_t* counts, const int32_t* expert, int n, int k,
                                 int experts) {
  const int64_t begin = int64_t{blockIdx.x} * kRouteTile;
  const int64_t end = min(begin + kRouteTile, int64_t{n} * k);
  int32_t* count = counts + int64_t{blockIdx.x} * experts;
  int64_t a;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    atomicAdd(&count[SlotMajorExpert(expert, i, n, k, &a)], 1);
  }
}

// counts[tile][e] becomes the assignments to e before the tile; routed[e] their total,
// offsets the prefix sums of min(routed, capacity). One block.
__global__ void RouteScanKernel(int32_t* counts, int tiles, int experts, int64_t capacity,
                                int64_t* routed, int64_t* offsets) {
  constexpr int kBatch = 16;  // tiles read before any is written: one wait per batch
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t run = 0;
    for (int first = 0; first < tiles; first += kBatch) {
      int32_t here[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        here[j] = first + j < tiles ? counts[int64_t{first + j} * experts + e] : 0;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (first + j < tiles) counts[int64_t{first + j} * experts + e] = static_cast<int32_t>(run);
        run += here[j];
      }
    }
    routed[e] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + min(routed[e], capacity);
  }
}

// One warp per tile: row[a] = offsets[e] + rank, or -1 past the capacity; bucket_token of
// each kept row. Lanes with the same expert take consecutive ranks in lane order; the
// tile's row of counts (its first rank per expert) is its next rank per expert.
__global__ void RoutePlaceKernel(int32_t* row, int32_t* bucket_token, int32_t* counts,
                                 const int64_t* offsets, const int32_t* expert, int n, int k,
                                 int experts, int64_t capacity, int tiles) {
  const int64_t tile = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (tile >= tiles) return;
  int32_t* next = counts + tile * experts;
  const int64_t begin = tile * kRouteTile;
  const int64_t end = min(begin + kRouteTile, int64_t{n} * k);
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    int64_t a = 0;
    const int e = i < end ? SlotMajorExpert(expert, i, n, k, &a) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int64_t rank = e >= 0 ? next[e] + __popc(same & ((1u << lane) - 1)) : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) next[e] += __popc(same);
    __syncwarp();
    if (e < 0) continue;
    if (rank < capacity) {
      const int64_t r = offsets[e] + rank;
      row[a] = static_cast<int32_t>(r);
      bucket_token[r] = static_cast<int32_t>(i % n);
    } else {
      row[a] = -1;
    }
  }
}

// Row kernels: one warp per row, its lanes across the row in V (float4 where every row
// starts 16-byte aligned, else float), so a row's index is read once, not per element.
template <typename V>
constexpr int kLanes = sizeof(V) / sizeof(float);

__device__ __forceinline__ void AddScaled(float& acc, float g, float v) { acc += g * v; }
__device__ __forceinline__ void AddScaled(float4& acc, float g, float4 v) {
  acc.x += g * v.x;
  acc.y += g * v.y;
  acc.z += g * v.z;
  acc.w += g * v.w;
}
__device__ __forceinline__ void Add(float& acc, float v) { acc += v; }
__device__ __forceinline__ void Add(float4& acc, float4 v) {
  acc.x += v.x;
  acc.y += v.y;
  acc.z += v.z;
  acc.w += v.w;
}
__device__ __forceinline__ double Dot(float a, float b) { return double{a} * b; }
__device__ __forceinline__ double Dot(float4 a, float4 b) {
  return double{a.x} * b.x + double{a.y} * b.y + double{a.z} * b.z + double{a.w} * b.w;
}

#define PITH_WARP_ROWS(r, rows)                                                       \
  for (int64_t r = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; r < (rows); \
       r += int64_t{gridDim.x} * blockDim.x / 32)

// dst[r] = src[src_row[r]] (Permute), or dst[dst_row[r]] = src[r] (ScatterRows).
template <typename V>
__global__ void MoveRowsKernel(V* dst, const V* src, const int32_t* index, bool scatter,
                               int64_t rows, int width) {
  const int lane = threadIdx.x % 32;
  PITH_WARP_ROWS(r, rows) {
    const int64_t to = scatter ? index[r] : r, from = scatter ? r : index[r];
    for (int c = lane; c < width; c += 32) dst[to * width + c] = src[from * width + c];
  }
}

template <typename V>
__global__ void PermuteBackwardKernel(V* dx, const V* dbucket, const int32_t* row, int n, int top_k,
                                      int width) {
  const int lane = threadIdx.x % 32;
  PITH_WARP_ROWS(t, n) {
    for (int c = lane; c < width; c += 32) {
      V sum{};
      for (int s = 0; s < top_k; ++s) {
        const int32_t r = row[t * top_k + s];
        if (r >= 0) Add(sum, dbucket[int64_t{r} * width + c]);
      }
      Add(dx[t * width + c], sum);
    }
  }
}

template <typename V>
__global__ void CombineKernel(V* out, const V* y, const int32_t* row, const float* gate, int n,
                              int top_k, int width) {
  const int lane = threadIdx.x % 32;
  PITH_WARP_ROWS(t, n) {
    for (int c = lane; c < width; c += 32) {
      V o{};
      for (int s = 0; s < top_k; ++s) {
        const int32_t r = row[t * top_k + s];
        if (r >= 0) AddScaled(o, gate[t * top_k + s], y[int64_t{r} * width + c]);
      }
      out[t * width + c] = o;
    }
  }
}

// One warp per assignment (token, slot).
template <typename V>
__global__ void CombineBackwardKernel(V* dy, float* dgate, const V* dout, const V* y,
                                      const int32_t* row, const float* gate, int n, int top_k,
                                      int width) {
  const int lane = threadIdx.x % 32;
  PITH_WARP_ROWS(a, int64_t{n} * top_k) {
    const int32_t r = row[a];
    if (r < 0) {
      if (lane == 0) dgate[a] = 0.0f;
      continue;
    }
    const float g = gate[a];
    const V* d = dout + (a / top_k) * width;
    const V* yr = y + int64_t{r} * width;
    V* dyr = dy + int64_t{r} * width;
    double dot = 0;
    for (int c = lane; c < width; c += 32) {
      V scaled{};
      AddScaled(scaled, g, d[c]);
      dyr[c] = scaled;
      dot += Dot(d[c], yr[c]);
    }
    dot = WarpSum(dot);
    if (lane == 0) dgate[a] = static_cast<float>(dot);
  }
}

// The segment (non-empty bucket) holding `row`: offsets[s] <= row < offsets[s + 1].
__device__ int SegmentOf(const int64_t* offsets, int count, int64_t row) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float Gelu(float v) { return GeluTanh(v); }
__device__ __forceinline__ float4 Gelu(float4 v) {
  return {GeluTanh(v.x), GeluTanh(v.y), GeluTanh(v.z), GeluTanh(v.w)};
}

// hpre += b1 of its bucket; h = gelu(hpre). A warp per row, its bucket found once.
template <typename V>
__global__ void BiasGeluKernel(V* hpre, V* h, const int64_t* offsets, const float* const* bias,
                               int count, int width) {
  const int lane = threadIdx.x % 32;
  PITH_WARP_ROWS(r, offsets[count]) {
    const V* b = reinterpret_cast<const V*>(bias[SegmentOf(offsets, count, r)]);
    for (int c = lane; c < width; c += 32) {
      V v = hpre[r * width + c];
      Add(v, b[c]);
      hpre[r * width + c] = v;
      h[r * width + c] = Gelu(v);
    }
  }
}

// out += the bias of its bucket, a warp per row.
template <typename V>
__global__ void SegmentBiasKernel(V* out, const int64_t* offsets, const float* const* bias,
                                  int count, int width) {
  const int lane = threadIdx.x % 32;
  PITH_WARP_ROWS(r, offsets[count]) {
    const V* b = reinterpret_cast<const V*>(bias[SegmentOf(offsets, count, r)]);
    for (int c = lane; c < width; c += 32) Add(out[r * width + c], b[c]);
  }
}

// bias_grad[s] += column sums of the rows of segment s (blockIdx.y).
__global__ void SegmentBiasGradKernel(float* const* bias_grad, const float* d,
                                      const int64_t* offsets, int n) {
  const int s = blockIdx.y;
  ColumnSumInto(bias_grad[s], d, offsets[s], offsets[s + 1], n);
}

__global__ void GeluBackwardInPlaceKernel(float* dh, const float* hpre, int64_t n) {
  PITH_GRID_STRIDE(i, n) dh[i] *= GeluTanhGrad(hpre[i]);
}

// One warp per token. dlogits = d(gates and router losses)/d logits through the softmax.
__global__ void RouteBackwardKernel(float* dlogits, const float* dgate, const float* probs,
                                    const float* lse, const int32_t* expert, const double* global_f,
                                    int n, int experts, int top_k, bool renormalize,
                                    double aux_coef, double z_coef, double inv_global) {
  const int64_t t = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  const float* p = probs + t * experts;
  float* dr = dlogits + t * experts;
  for (int e = lane; e < experts; e += 32) {
    dr[e] =
        aux_coef != 0 ? static_cast<float>(aux_coef * experts * global_f[e] * inv_global) : 0.0f;
  }
  __syncwarp();
  const int32_t* chosen = expert + t * top_k;
  const float* dg = dgate + t * top_k;
  if (renormalize) {
    double sum = 0, weighted = 0;
    for (int s = 0; s < top_k; ++s) {
      sum += p[chosen[s]];
      weighted += double{dg[s]} * p[chosen[s]];
    }
    for (int s = lane; s < top_k; s += 32) {
      dr[chosen[s]] += static_cast<float>(dg[s] / sum - weighted / (sum * sum));
    }
  } else {
    for (int s = lane; s < top_k; s += 32) dr[chosen[s]] += dg[s];
  }
  __syncwarp();
  double dot = 0;
  for (int e = lane; e < experts; e += 32) dot += double{dr[e]} * p[e];
  dot = WarpSum(dot);
  const double z = z_coef * 2.0 * lse[t] * inv_global;
  __syncwarp();
  for (int e = lane; e < experts; e += 32) {
    dr[e] = static_cast<float>(p[e] * (dr[e] - dot) + z * p[e]);
  }
}

}  // namespace

void CudaBackend::Route(const float* logits, int n, int experts,
                        const compute::RouterConfig& config, const compute::RoutingBuffers& out) {
  const int k = config.top_k;
  std::fill(out.routed, out.routed + experts, 0);
  std::fill(out.prob_sum, out.prob_sum + experts, 0.0);
  std::fill(out.offsets, out.offsets + experts + 1, 0);
  if (n == 0 || !Ready()) return;
  if (k < 1 || k > experts || int64_t{n} * k > INT32_MAX) {
    // Rows and ranks are int32, like the interface's `row`.
    Fail("Route", absl::StrCat("top_k ", k, " of ", experts, " experts for ", n,
                               " tokens: want 1 <= top_k <= experts and tokens * top_k < 2^31"));
    return;
  }
  RouteKernel<<<WarpBlocks(n), kThreads, 0, S(stream_)>>>(logits, n, experts, k, config.renormalize,
                                                          out.probs, out.lse, out.expert, out.gate);
  // What comes back to the host, in one copy: prob_sum [E], routed [E], offsets [E + 1].
  const size_t back = sizeof(int64_t) * (3 * experts + 1);
  auto* prob_sum = static_cast<double*>(Scratch(kRouting, back));
  const int64_t assignments = int64_t{n} * k;
  const int tiles = static_cast<int>((assignments + kRouteTile - 1) / kRouteTile);
  const size_t count_bytes = sizeof(int32_t) * experts * tiles;
  auto* counts = static_cast<int32_t*>(Scratch(kRouteTiles, count_bytes));
  if (prob_sum == nullptr || counts == nullptr) return;
  auto* routed = reinterpret_cast<int64_t*>(prob_sum + experts);
  int64_t* offsets = routed + experts;
  const int64_t capacity =
      config.capacity_factor > 0
          ? static_cast<int64_t>(std::ceil(config.capacity_factor * k * n / experts))
          : assignments;
  ProbSumKernel<<<experts, kThreads, 0, S(stream_)>>>(prob_sum, out.probs, n, experts);
  if (!CheckCuda(cudaMemsetAsync(counts, 0, count_bytes, S(stream_)), "Route (counts)")) return;
  RouteCountKernel<<<tiles, kThreads, 0, S(stream_)>>>(counts, out.expert, n, k, experts);
  RouteScanKernel<<<1, kThreads, 0, S(stream_)>>>(counts, tiles, experts, capacity, routed,
                                                  offsets);
  RoutePlaceKernel<<<WarpBlocks(tiles), kThreads, 0, S(stream_)>>>(
      out.row, out.bucket_token, counts, offsets, out.expert, n, k, experts, capacity, tiles);
  if (!CheckLaunch("Route")) return;
  host_back_.resize(3 * experts + 1);
  if (!CopyToHost(host_back_.data(), prob_sum, back).ok()) return;
  std::memcpy(out.prob_sum, host_back_.data(), sizeof(double) * experts);
  std::copy_n(host_back_.data() + experts, experts, out.routed);
  std::copy_n(host_back_.data() + 2 * experts, experts + 1, out.offsets);
}

void CudaBackend::Permute(float* bucket, const float* x, const int32_t* bucket_token, int64_t rows,
                          int channels) {
  if (rows * channels == 0 || !Ready()) return;
  if (ByFloat4(channels, {bucket, x})) {
    MoveRowsKernel<<<RowBlocks(rows), kThreads, 0, S(stream_)>>>(
        As<float4>(bucket), As<float4>(x), bucket_token, false, rows, channels / 4);
  } else {
    MoveRowsKernel<<<RowBlocks(rows), kThreads, 0, S(stream_)>>>(bucket, x, bucket_token, false,
                                                                 rows, channels);
  }
  CheckLaunch("Permute");
}

void CudaBackend::ScatterRows(float* dst, const float* src, const int32_t* dst_row, int64_t rows,
                              int channels) {
  if (rows * channels == 0 || !Ready()) return;
  if (ByFloat4(channels, {dst, src})) {
    MoveRowsKernel<<<RowBlocks(rows), kThreads, 0, S(stream_)>>>(As<float4>(dst), As<float4>(src),
                                                                 dst_row, true, rows, channels / 4);
  } else {
    MoveRowsKernel<<<RowBlocks(rows), kThreads, 0, S(stream_)>>>(dst, src, dst_row, true, rows,
                                                                 channels);
  }
  CheckLaunch("ScatterRows");
}

void CudaBackend::PermuteBackward(float* dx, const float* dbucket, const int32_t* row, int n,
                                  int top_k, int channels) {
  if (int64_t{n} * channels == 0 || !Ready()) return;
  if (ByFloat4(channels, {dx, dbucket})) {
    PermuteBackwardKernel<<<RowBlocks(n), kThreads, 0, S(stream_)>>>(
        As<float4>(dx), As<float4>(dbucket), row, n, top_k, channels / 4);
  } else {
    PermuteBackwardKernel<<<RowBlocks(n), kThreads, 0, S(stream_)>>>(dx, dbucket, row, n, top_k,
                                                                     channels);
  }
  CheckLaunch("PermuteBackward");
}

void CudaBackend::Combine(float* out, const float* y, const int32_t* row, const float* gate, int n,
                          int top_k, int channels) {
  if (int64_t{n} * channels == 0 || !Ready()) return;
  if (ByFloat4(channels, {out, y})) {
    CombineKernel<<<RowBlocks(n), kThreads, 0, S(stream_)>>>(As<float4>(out), As<float4>(y), row,
                                                             gate, n, top_k, channels / 4);
  } else {
    CombineKernel<<<RowBlocks(n), kThreads, 0, S(stream_)>>>(out, y, row, gate, n, top_k, channels);
  }
  CheckLaunch("Combine");
}

void CudaBackend::CombineBackward(float* dy, float* dgate, const float* dout, const float* y,
                                  const int32_t* row, const float* gate, int n, int top_k,
                                  int channels) {
  const int64_t assignments = int64_t{n} * top_k;
  if (assignments == 0 || !Ready()) return;
  if (ByFloat4(channels, {dy, dout, y})) {
    CombineBackwardKernel<<<RowBlocks(assignments), kThreads, 0, S(stream_)>>>(
        As<float4>(dy), dgate, As<float4>(dout), As<float4>(y), row, gate, n, top_k, channels / 4);
  } else {
    CombineBackwardKernel<<<RowBlocks(assignments), kThreads, 0, S(stream_)>>>(
        dy, dgate, dout, y, row, gate, n, top_k, channels);
  }
  CheckLaunch("CombineBackward");
}

CudaBackend::Segments CudaBackend::UploadSegments(const int64_t* offsets, int experts,
                                                  const float* const* bias,
                                                  float* const* bias_grad) {
  Segments seg;
  std::vector<int64_t> rows;
  std::vector<const void*> pointers;
  for (int e = 0; e < experts; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    rows.push_back(offsets[e]);
    pointers.push_back(bias != nullptr ? bias[e] : bias_grad[e]);
    seg.aligned &= reinterpret_cast<uintptr_t>(pointers.back()) % alignof(float4) == 0;
  }
  seg.count = static_cast<int>(rows.size());
  if (seg.count == 0) return seg;
  rows.push_back(offsets[experts]);
  const size_t row_bytes = rows.size() * sizeof(int64_t);
  const size_t bytes = row_bytes + pointers.size() * sizeof(void*);
  char* dev = static_cast<char*>(Scratch(kSegments, bytes));
  if (dev == nullptr) return Segments{};
  std::vector<char> host(bytes);
  std::copy_n(reinterpret_cast<const char*>(rows.data()), row_bytes, host.data());
  std::copy_n(reinterpret_cast<const char*>(pointers.data()), bytes - row_bytes,
              host.data() + row_bytes);
  if (!CheckCuda(cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, S(stream_)),
                 "expert segments")) {
    return Segments{};
  }
  seg.offsets = reinterpret_cast<int64_t*>(dev);
  seg.bias = reinterpret_cast<const float**>(dev + row_bytes);
  seg.bias_grad = reinterpret_cast<float**>(dev + row_bytes);
  return seg;
}

void CudaBackend::ExpertForward(float* y, float* hpre, float* h, const float* x,
                                const int64_t* offsets,
                                absl::Span<const compute::ExpertWeights> experts, int channels,
                                int hidden) {
  const int count = static_cast<int>(experts.size());
  if (offsets[count] == 0 || !Ready()) return;
  const int64_t total = offsets[count];
  // Fused (FuseExpertPasses): the first products' epilogue adds b1 and writes gelu's
  // output in fp32 and in bf16, which the second products read as it is; theirs adds b2.
  __nv_bfloat16* h_bf16 = nullptr;
  if (FuseExpertPasses()) {
    h_bf16 = static_cast<__nv_bfloat16*>(Scratch(kBf16Activation, 2 * total * hidden));
    if (h_bf16 == nullptr) return;
  }
  std::vector<GemmProblem> first, second;
  std::vector<const float*> b1(count), b2(count);
  for (int e = 0; e < count; ++e) {
    b1[e] = experts[e].b1;
    b2[e] = experts[e].b2;
    const int64_t begin = offsets[e];
    const int rows = static_cast<int>(offsets[e + 1] - begin);
    if (rows == 0) continue;
    first.push_back({false, false, rows, hidden, channels, x + begin * channels, channels,
                     experts[e].w1, hidden, 0.0f, hpre + begin * hidden, hidden, 1.0f,
                     experts[e].w1_bf16});
    second.push_back({false, false, rows, channels, hidden, h + begin * hidden, hidden,
                      experts[e].w2, channels, 0.0f, y + begin * channels, channels, 1.0f,
                      experts[e].w2_bf16});
    if (h_bf16 != nullptr) {
      first.back().epilogue.bias = b1[e];
      first.back().epilogue.gelu_out = h + begin * hidden;
      first.back().epilogue.gelu_bf16 = h_bf16 + begin * hidden;
      second.back().epilogue.bias = b2[e];
    }
  }
  // Products says whether the epilogues ran (vacuously so without any).
  if (Products(first, "ExpertForward (x @ w1)") && h_bf16 != nullptr) {
    for (size_t i = 0; i < second.size(); ++i) {
      second[i].a_bf16 = h_bf16 + (second[i].a - h);  // gelu's output, already in bf16
    }
  } else {
    Segments seg = UploadSegments(offsets, count, b1.data(), nullptr);
    if (seg.count == 0 || !Ready()) return;
    if (seg.aligned && ByFloat4(hidden, {hpre, h})) {
      BiasGeluKernel<<<RowBlocks(total), kThreads, 0, S(stream_)>>>(
          As<float4>(hpre), As<float4>(h), seg.offsets, seg.bias, seg.count, hidden / 4);
    } else {
      BiasGeluKernel<<<RowBlocks(total), kThreads, 0, S(stream_)>>>(hpre, h, seg.offsets, seg.bias,
                                                                    seg.count, hidden);
    }
    if (!CheckLaunch("ExpertForward (bias, gelu)")) return;
  }
  if (Products(second, "ExpertForward (h @ w2)") && h_bf16 != nullptr) return;
  Segments seg = UploadSegments(offsets, count, b2.data(), nullptr);
  if (seg.count == 0 || !Ready()) return;
  if (seg.aligned && ByFloat4(channels, {y})) {
    SegmentBiasKernel<<<RowBlocks(total), kThreads, 0, S(stream_)>>>(
        As<float4>(y), seg.offsets, seg.bias, seg.count, channels / 4);
  } else {
    SegmentBiasKernel<<<RowBlocks(total), kThreads, 0, S(stream_)>>>(y, seg.offsets, seg.bias,
                                                                     seg.count, channels);
  }
  CheckLaunch("ExpertForward (bias)");
}

void CudaBackend::ExpertBackward(float* dx, float* dh, absl::Span<const compute::ExpertGrads> grads,
                                 const float* dy, const float* x, const float* hpre, const float* h,
                                 const int64_t* offsets,
                                 absl::Span<const compute::ExpertWeights> experts, int channels,
                                 int hidden) {
  const int count = static_cast<int>(experts.size());
  if (offsets[count] == 0 || !Ready()) return;
  const int64_t total = offsets[count];
  // Fused (FuseExpertPasses): dH's epilogue applies gelu's derivative and writes a bf16
  // copy, which the last products read as it is.
  __nv_bfloat16* dh_bf16 = nullptr;
  if (FuseExpertPasses()) {
    dh_bf16 = static_cast<__nv_bfloat16*>(Scratch(kBf16Activation, 2 * total * hidden));
    if (dh_bf16 == nullptr) return;
  }
  std::vector<GemmProblem> second, first;
  std::vector<float*> db1(count), db2(count);
  for (int e = 0; e < count; ++e) {
    db1[e] = grads[e].b1;
    db2[e] = grads[e].b2;
    const int64_t begin = offsets[e];
    const int rows = static_cast<int>(offsets[e + 1] - begin);
    if (rows == 0) continue;
    const float* dye = dy + begin * channels;
    const float* dhe = dh + begin * hidden;
    // dH = dY W2^T; dW2 += H^T dY.
    second.push_back({false, true, rows, hidden, channels, dye, channels, experts[e].w2, channels,
                      0.0f, dh + begin * hidden, hidden, 1.0f, experts[e].w2_bf16});
    if (dh_bf16 != nullptr) {
      second.back().epilogue.gelu_grad_of = hpre + begin * hidden;
      second.back().epilogue.c_bf16 = dh_bf16 + begin * hidden;
    }
    second.push_back({true, false, hidden, channels, rows, h + begin * hidden, hidden, dye,
                      channels, 1.0f, grads[e].w2, channels});
    // dW1 += X^T dHpre; dX = dHpre W1^T.
    first.push_back({true, false, channels, hidden, rows, x + begin * channels, channels, dhe,
                     hidden, 1.0f, grads[e].w1, hidden});
    first.push_back({false, true, rows, channels, hidden, dhe, hidden, experts[e].w1, hidden, 0.0f,
                     dx + begin * channels, channels, 1.0f, experts[e].w1_bf16});
  }
  const bool fused = Products(second, "ExpertBackward (dH, dW2)") && dh_bf16 != nullptr;
  Segments seg = UploadSegments(offsets, count, nullptr, db2.data());
  if (seg.count == 0 || !Ready()) return;
  SegmentBiasGradKernel<<<dim3((channels + 31) / 32, seg.count), dim3(32, 8), 0, S(stream_)>>>(
      seg.bias_grad, dy, seg.offsets, channels);
  if (!fused) {
    GeluBackwardInPlaceKernel<<<GridFor(total * hidden), kThreads, 0, S(stream_)>>>(dh, hpre,
                                                                                    total * hidden);
  }
  if (!CheckLaunch("ExpertBackward (db2, gelu)")) return;
  for (size_t i = 0; fused && i < first.size(); i += 2) {
    first[i].b_bf16 = dh_bf16 + (first[i].b - dh);          // dW1's dHpre, already in bf16
    first[i + 1].a_bf16 = dh_bf16 + (first[i + 1].a - dh);  // dX's
  }
  Products(first, "ExpertBackward (dW1, dX)");
  seg = UploadSegments(offsets, count, nullptr, db1.data());
  if (seg.count == 0 || !Ready()) return;
  SegmentBiasGradKernel<<<dim3((hidden + 31) / 32, seg.count), dim3(32, 8), 0, S(stream_)>>>(
      seg.bias_grad, dh, seg.offsets, hidden);
  CheckLaunch("ExpertBackward (db1)");
}

void CudaBackend::RouteBackward(float* dlogits, const float* dgate,
                                const compute::RoutingBuffers& routing, int n, int experts,
                                const compute::RouterConfig& config,
                                const compute::RouterLossGrad& loss) {
  if (n == 0 || !Ready()) return;
  double* global_f = static_cast<double*>(Scratch(kRouting, sizeof(double) * experts));
  if (global_f == nullptr) return;
  if (loss.aux_coef != 0 &&
      !CheckCuda(cudaMemcpyAsync(global_f, loss.global_f, sizeof(double) * experts,
                                 cudaMemcpyHostToDevice, S(stream_)),
                 "RouteBackward (global f)")) {
    return;
  }
  RouteBackwardKernel<<<WarpBlocks(n), kThreads, 0, S(stream_)>>>(
      dlogits, dgate, routing.probs, routing.lse, routing.expert, global_f, n, experts,
      config.top_k, config.renormalize, loss.aux_coef, loss.z_coef,
      1.0 / static_cast<double>(loss.global_tokens));
  CheckLaunch("RouteBackward");
}

}  // namespace pith::cuda
