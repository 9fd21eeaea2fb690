// CudaBackend: routing, token permutation, the grouped expert FFN and the router backward.
//
// Route computes the softmax and top-k on the device, then lays out the buckets on the
// host (the layout is a host output: it sizes the grouped GEMMs), exactly as the CPU
// backend does, and uploads the rows. The expert FFN is two grouped GEMMs forward and two
// backward (each one cuBLAS call over the non-empty buckets), with the bias, gelu and
// bias-gradient kernels addressing the buckets through a small segment table.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

cudaStream_t S(CUstream_st* s) { return s; }

int WarpBlocks(int64_t warps) {
  return static_cast<int>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// One warp per token: softmax (in double, as the CPU backend), logsumexp, and the top-k
// by probability (ties: the lower id), renormalized if asked.
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
      if (!taken && (p[e] > best_p || (p[e] == best_p && e < best))) {
        best_p = p[e];
        best = e;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, best_p, offset);
      const int oe = __shfl_xor_sync(0xffffffffu, best, offset);
      if (op > best_p || (op == best_p && oe < best)) {
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

__global__ void PermuteKernel(float* bucket, const float* x, const int32_t* bucket_token,
                              int64_t rows, int channels) {
  PITH_GRID_STRIDE(i, rows * channels) {
    bucket[i] = x[int64_t{bucket_token[i / channels]} * channels + i % channels];
  }
}

__global__ void ScatterRowsKernel(float* dst, const float* src, const int32_t* dst_row,
                                  int64_t rows, int channels) {
  PITH_GRID_STRIDE(i, rows * channels) {
    dst[int64_t{dst_row[i / channels]} * channels + i % channels] = src[i];
  }
}

__global__ void PermuteBackwardKernel(float* dx, const float* dbucket, const int32_t* row, int n,
                                      int top_k, int channels) {
  PITH_GRID_STRIDE(i, int64_t{n} * channels) {
    const int64_t t = i / channels, c = i % channels;
    float sum = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      const int32_t r = row[t * top_k + s];
      if (r >= 0) sum += dbucket[int64_t{r} * channels + c];
    }
    dx[i] += sum;
  }
}

__global__ void CombineKernel(float* out, const float* y, const int32_t* row, const float* gate,
                              int n, int top_k, int channels) {
  PITH_GRID_STRIDE(i, int64_t{n} * channels) {
    const int64_t t = i / channels, c = i % channels;
    float o = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      const int32_t r = row[t * top_k + s];
      if (r >= 0) o += gate[t * top_k + s] * y[int64_t{r} * channels + c];
    }
    out[i] = o;
  }
}

// One warp per assignment (token, slot).
__global__ void CombineBackwardKernel(float* dy, float* dgate, const float* dout, const float* y,
                                      const int32_t* row, const float* gate, int n, int top_k,
                                      int channels) {
  const int64_t a = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (a >= int64_t{n} * top_k) return;
  const int32_t r = row[a];
  if (r < 0) {
    if (lane == 0) dgate[a] = 0.0f;
    return;
  }
  const float g = gate[a];
  const float* d = dout + (a / top_k) * channels;
  const float* yr = y + int64_t{r} * channels;
  float* dyr = dy + int64_t{r} * channels;
  double dot = 0;
  for (int c = lane; c < channels; c += 32) {
    dyr[c] = g * d[c];
    dot += double{d[c]} * yr[c];
  }
  dot = WarpSum(dot);
  if (lane == 0) dgate[a] = static_cast<float>(dot);
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

// hpre += b1 of its bucket; h = gelu(hpre).
__global__ void BiasGeluKernel(float* hpre, float* h, const int64_t* offsets,
                               const float* const* bias, int count, int hidden) {
  PITH_GRID_STRIDE(i, offsets[count] * hidden) {
    const int64_t r = i / hidden;
    const float v = hpre[i] + bias[SegmentOf(offsets, count, r)][i % hidden];
    hpre[i] = v;
    h[i] = GeluTanh(v);
  }
}

__global__ void SegmentBiasKernel(float* out, const int64_t* offsets, const float* const* bias,
                                  int count, int n) {
  PITH_GRID_STRIDE(i, offsets[count] * n) {
    out[i] += bias[SegmentOf(offsets, count, i / n)][i % n];
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
  RouteKernel<<<WarpBlocks(n), kThreads, 0, S(stream_)>>>(logits, n, experts, k, config.renormalize,
                                                          out.probs, out.lse, out.expert, out.gate);
  double* prob_sum = static_cast<double*>(Scratch(kRouting, sizeof(double) * experts));
  if (prob_sum == nullptr) return;
  ProbSumKernel<<<experts, kThreads, 0, S(stream_)>>>(prob_sum, out.probs, n, experts);
  if (!CheckLaunch("Route")) return;
  const int64_t assignments = int64_t{n} * k;
  host_ints_.resize(2 * assignments);
  int32_t* chosen = host_ints_.data();
  int32_t* rows = chosen + assignments;
  if (!CopyToHost(chosen, out.expert, sizeof(int32_t) * assignments).ok() ||
      !CopyToHost(out.prob_sum, prob_sum, sizeof(double) * experts).ok()) {
    return;
  }
  // The bucket layout, slot-major as the CPU backend (cpu_backend_moe.cc).
  const int64_t capacity =
      config.capacity_factor > 0
          ? static_cast<int64_t>(std::ceil(config.capacity_factor * k * n / experts))
          : assignments;
  std::vector<int64_t> next(experts, 0);
  for (int s = 0; s < k; ++s) {
    for (int64_t t = 0; t < n; ++t) {
      const int e = chosen[t * k + s];
      ++out.routed[e];
      rows[t * k + s] = next[e] < capacity ? (++next[e], 0) : -1;
    }
  }
  for (int e = 0; e < experts; ++e) out.offsets[e + 1] = out.offsets[e] + next[e];
  std::copy(out.offsets, out.offsets + experts, next.begin());
  std::vector<int32_t> bucket_token(out.offsets[experts]);
  for (int s = 0; s < k; ++s) {
    for (int64_t t = 0; t < n; ++t) {
      int32_t& row = rows[t * k + s];
      if (row < 0) continue;
      row = static_cast<int32_t>(next[chosen[t * k + s]]++);
      bucket_token[row] = static_cast<int32_t>(t);
    }
  }
  // Pageable sources: the copies have read them when cudaMemcpyAsync returns.
  CheckCuda(cudaMemcpyAsync(out.row, rows, sizeof(int32_t) * assignments, cudaMemcpyHostToDevice,
                            S(stream_)),
            "Route (rows)");
  if (!bucket_token.empty()) {
    CheckCuda(
        cudaMemcpyAsync(out.bucket_token, bucket_token.data(),
                        sizeof(int32_t) * bucket_token.size(), cudaMemcpyHostToDevice, S(stream_)),
        "Route (bucket tokens)");
  }
}

void CudaBackend::Permute(float* bucket, const float* x, const int32_t* bucket_token, int64_t rows,
                          int channels) {
  if (rows * channels == 0 || !Ready()) return;
  PermuteKernel<<<GridFor(rows * channels), kThreads, 0, S(stream_)>>>(bucket, x, bucket_token,
                                                                       rows, channels);
  CheckLaunch("Permute");
}

void CudaBackend::ScatterRows(float* dst, const float* src, const int32_t* dst_row, int64_t rows,
                              int channels) {
  if (rows * channels == 0 || !Ready()) return;
  ScatterRowsKernel<<<GridFor(rows * channels), kThreads, 0, S(stream_)>>>(dst, src, dst_row, rows,
                                                                           channels);
  CheckLaunch("ScatterRows");
}

void CudaBackend::PermuteBackward(float* dx, const float* dbucket, const int32_t* row, int n,
                                  int top_k, int channels) {
  if (int64_t{n} * channels == 0 || !Ready()) return;
  PermuteBackwardKernel<<<GridFor(int64_t{n} * channels), kThreads, 0, S(stream_)>>>(
      dx, dbucket, row, n, top_k, channels);
  CheckLaunch("PermuteBackward");
}

void CudaBackend::Combine(float* out, const float* y, const int32_t* row, const float* gate, int n,
                          int top_k, int channels) {
  if (int64_t{n} * channels == 0 || !Ready()) return;
  CombineKernel<<<GridFor(int64_t{n} * channels), kThreads, 0, S(stream_)>>>(out, y, row, gate, n,
                                                                             top_k, channels);
  CheckLaunch("Combine");
}

void CudaBackend::CombineBackward(float* dy, float* dgate, const float* dout, const float* y,
                                  const int32_t* row, const float* gate, int n, int top_k,
                                  int channels) {
  if (int64_t{n} * top_k == 0 || !Ready()) return;
  CombineBackwardKernel<<<WarpBlocks(int64_t{n} * top_k), kThreads, 0, S(stream_)>>>(
      dy, dgate, dout, y, row, gate, n, top_k, channels);
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
    BiasGeluKernel<<<GridFor(total * hidden), kThreads, 0, S(stream_)>>>(
        hpre, h, seg.offsets, seg.bias, seg.count, hidden);
    if (!CheckLaunch("ExpertForward (bias, gelu)")) return;
  }
  if (Products(second, "ExpertForward (h @ w2)") && h_bf16 != nullptr) return;
  Segments seg = UploadSegments(offsets, count, b2.data(), nullptr);
  if (seg.count == 0 || !Ready()) return;
  SegmentBiasKernel<<<GridFor(total * channels), kThreads, 0, S(stream_)>>>(
      y, seg.offsets, seg.bias, seg.count, channels);
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
