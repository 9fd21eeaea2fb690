// CudaBackend: the dense layers' ops — embedding, LayerNorm, causal attention (cuBLAS
// strided-batched products around a causal softmax kernel), gelu and the cross-entropy.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>

#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr int kWarpsPerBlock = kThreads / 32;

cudaStream_t S(CUstream_st* s) { return s; }
cublasHandle_t H(cublasContext* h) { return h; }
cublasOperation_t Op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

__global__ void EmbeddingKernel(float* out, const int32_t* tokens, const float* wte,
                                const float* wpe, int64_t rows, int seq, int channels) {
  PITH_GRID_STRIDE(i, rows * channels) {
    const int64_t r = i / channels, c = i % channels;
    out[i] = wte[int64_t{tokens[r]} * channels + c] + wpe[(r % seq) * channels + c];
  }
}

__global__ void EmbeddingBackwardKernel(float* dwte, float* dwpe, const float* dout,
                                        const int32_t* tokens, int64_t rows, int seq,
                                        int channels) {
  PITH_GRID_STRIDE(i, rows * channels) {
    const int64_t r = i / channels, c = i % channels;
    atomicAdd(&dwte[int64_t{tokens[r]} * channels + c], dout[i]);
    atomicAdd(&dwpe[(r % seq) * channels + c], dout[i]);
  }
}

// One warp per row.
__global__ void LayerNormKernel(float* out, float* mean, float* rstd, const float* x,
                                const float* w, const float* b, int n, int channels) {
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xi = x + row * channels;
  float sum = 0.0f;
  for (int c = lane; c < channels; c += 32) sum += xi[c];
  const float m = WarpSum(sum) / channels;
  float var = 0.0f;
  for (int c = lane; c < channels; c += 32) var += (xi[c] - m) * (xi[c] - m);
  const float s = rsqrtf(WarpSum(var) / channels + kLayerNormEps);
  float* o = out + row * channels;
  for (int c = lane; c < channels; c += 32) o[c] = (xi[c] - m) * s * w[c] + b[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// dx (accumulated), one warp per row.
__global__ void LayerNormBackwardKernel(float* dx, const float* dout, const float* x,
                                        const float* w, const float* mean, const float* rstd, int n,
                                        int channels) {
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xi = x + row * channels;
  const float* di = dout + row * channels;
  const float m = mean[row], s = rstd[row];
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
  for (int c = lane; c < channels; c += 32) {
    const float dnorm = w[c] * di[c];
    dnorm_mean += dnorm;
    dnorm_norm_mean += dnorm * (xi[c] - m) * s;
  }
  dnorm_mean = WarpSum(dnorm_mean) / channels;
  dnorm_norm_mean = WarpSum(dnorm_norm_mean) / channels;
  float* dxi = dx + row * channels;
  for (int c = lane; c < channels; c += 32) {
    const float norm = (xi[c] - m) * s;
    dxi[c] += (w[c] * di[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

// dw and db (accumulated): column sums, launched as ColumnSumInto.
__global__ void LayerNormParamGradKernel(float* dw, float* db, const float* dout, const float* x,
                                         const float* mean, const float* rstd, int n,
                                         int channels) {
  __shared__ float pw[8][33], pb[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float sw = 0.0f, sb = 0.0f;
  if (col < channels) {
    for (int64_t r = threadIdx.y; r < n; r += 8) {
      const float d = dout[r * channels + col];
      sw += (x[r * channels + col] - mean[r]) * rstd[r] * d;
      sb += d;
    }
  }
  pw[threadIdx.y][threadIdx.x] = sw;
  pb[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && col < channels) {
    float tw = 0.0f, tb = 0.0f;
    for (int i = 0; i < 8; ++i) {
      tw += pw[i][threadIdx.x];
      tb += pb[i][threadIdx.x];
    }
    dw[col] += tw;
    db[col] += tb;
  }
}

// Causal softmax of the [rows, seq] score rows in place, one warp per row; the entries
// above the diagonal become exact zeros.
__global__ void CausalSoftmaxKernel(float* att, int64_t rows, int seq) {
  const int64_t r = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int t = static_cast<int>(r % seq);
  float* row = att + r * seq;
  float mx = -INFINITY;
  for (int j = lane; j <= t; j += 32) mx = fmaxf(mx, row[j]);
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (int j = lane; j <= t; j += 32) {
    const float e = expf(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / WarpSum(sum);
  for (int j = lane; j < seq; j += 32) row[j] = j <= t ? row[j] * inv : 0.0f;
}

// dS = P * (dP - rowsum(dP * P)) in place of dP, one warp per row.
__global__ void CausalSoftmaxBackwardKernel(float* dp, const float* p, int64_t rows, int seq) {
  const int64_t r = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int t = static_cast<int>(r % seq);
  float* drow = dp + r * seq;
  const float* prow = p + r * seq;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += 32) dot += drow[j] * prow[j];
  dot = WarpSum(dot);
  for (int j = lane; j < seq; j += 32) drow[j] = j <= t ? prow[j] * (drow[j] - dot) : 0.0f;
}

__global__ void GeluKernel(float* out, const float* x, int64_t n) {
  PITH_GRID_STRIDE(i, n) out[i] = GeluTanh(x[i]);
}

__global__ void GeluBackwardKernel(float* dx, const float* x, const float* dout, int64_t n) {
  PITH_GRID_STRIDE(i, n) dx[i] = dout[i] * GeluTanhGrad(x[i]);
}

// One block per row: losses[i] = lse - logit[target]; the row becomes softmax * scale,
// less scale at the target.
__global__ void CrossEntropyKernel(float* logits, float* losses, const int32_t* targets, int vocab,
                                   float scale) {
  __shared__ float fshared[32];
  __shared__ double dshared[32];
  float* row = logits + int64_t{blockIdx.x} * vocab;
  const int target = targets[blockIdx.x];
  const float target_logit = row[target];
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = BlockMax(mx, fshared);
  double sum = 0;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) sum += exp(double{row[j]} - mx);
  const double lse = mx + log(BlockSum(sum, dshared));
  if (threadIdx.x == 0) losses[blockIdx.x] = static_cast<float>(lse - target_logit);
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float p = static_cast<float>(exp(double{row[j]} - lse)) * scale;
    row[j] = j == target ? p - scale : p;
  }
}

int RowBlocks(int64_t rows) {
  return static_cast<int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void CudaBackend::Embedding(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                            int batch, int seq, int channels) {
  const int64_t rows = int64_t{batch} * seq;
  if (rows * channels == 0 || !Ready()) return;
  EmbeddingKernel<<<GridFor(rows * channels), kThreads, 0, S(stream_)>>>(out, tokens, wte, wpe,
                                                                         rows, seq, channels);
  CheckLaunch("Embedding");
}

void CudaBackend::EmbeddingBackward(float* dwte, float* dwpe, const float* dout,
                                    const int32_t* tokens, int batch, int seq, int channels) {
  const int64_t rows = int64_t{batch} * seq;
  if (rows * channels == 0 || !Ready()) return;
  EmbeddingBackwardKernel<<<GridFor(rows * channels), kThreads, 0, S(stream_)>>>(
      dwte, dwpe, dout, tokens, rows, seq, channels);
  CheckLaunch("EmbeddingBackward");
}

void CudaBackend::LayerNorm(float* out, float* mean, float* rstd, const float* x, const float* w,
                            const float* b, int n, int channels) {
  if (n == 0 || !Ready()) return;
  LayerNormKernel<<<RowBlocks(n), kThreads, 0, S(stream_)>>>(out, mean, rstd, x, w, b, n, channels);
  CheckLaunch("LayerNorm");
}

void CudaBackend::LayerNormBackward(float* dx, float* dw, float* db, const float* dout,
                                    const float* x, const float* w, const float* mean,
                                    const float* rstd, int n, int channels) {
  if (n == 0 || !Ready()) return;
  LayerNormBackwardKernel<<<RowBlocks(n), kThreads, 0, S(stream_)>>>(dx, dout, x, w, mean, rstd, n,
                                                                     channels);
  LayerNormParamGradKernel<<<(channels + 31) / 32, dim3(32, 8), 0, S(stream_)>>>(
      dw, db, dout, x, mean, rstd, n, channels);
  CheckLaunch("LayerNormBackward");
}

namespace {

// Row-major strided-batched product (the Gemm convention), `count` problems.
cublasStatus_t BatchedGemm(cublasHandle_t blas, bool ta, bool tb, int m, int n, int k, float alpha,
                           const float* a, int lda, int64_t stride_a, const float* b, int ldb,
                           int64_t stride_b, float* c, int ldc, int64_t stride_c, int count) {
  const float beta = 0.0f;
  return cublasSgemmStridedBatched(blas, Op(tb), Op(ta), n, m, k, &alpha, b, ldb, stride_b, a, lda,
                                   stride_a, &beta, c, ldc, stride_c, count);
}

}  // namespace

void CudaBackend::Attention(float* out, float* att, const float* qkv, int batch, int seq,
                            int channels, int heads) {
  if (int64_t{batch} * seq == 0 || !Ready()) return;
  const int hs = channels / heads, ld = 3 * channels;
  const int64_t tt = int64_t{seq} * seq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < batch; ++b) {
    const float* q = qkv + int64_t{b} * seq * ld;
    float* p = att + int64_t{b} * heads * tt;
    if (!CheckBlas(BatchedGemm(H(blas_), false, true, seq, seq, hs, scale, q, ld, hs, q + channels,
                               ld, hs, p, seq, tt, heads),
                   "Attention (scores)")) {
      return;
    }
  }
  const int64_t rows = int64_t{batch} * heads * seq;
  CausalSoftmaxKernel<<<RowBlocks(rows), kThreads, 0, S(stream_)>>>(att, rows, seq);
  if (!CheckLaunch("Attention (softmax)")) return;
  for (int b = 0; b < batch; ++b) {
    const float* v = qkv + int64_t{b} * seq * ld + 2 * channels;
    if (!CheckBlas(
            BatchedGemm(H(blas_), false, false, seq, hs, seq, 1.0f, att + b * heads * tt, seq, tt,
                        v, ld, hs, out + int64_t{b} * seq * channels, channels, hs, heads),
            "Attention (values)")) {
      return;
    }
  }
}

void CudaBackend::AttentionBackward(float* dqkv, const float* dout, const float* qkv,
                                    const float* att, int batch, int seq, int channels, int heads) {
  if (int64_t{batch} * seq == 0 || !Ready()) return;
  const int hs = channels / heads, ld = 3 * channels;
  const int64_t tt = int64_t{seq} * seq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* dp_all = static_cast<float*>(Scratch(kAttention, sizeof(float) * batch * heads * tt));
  if (dp_all == nullptr) return;
  for (int b = 0; b < batch; ++b) {
    const float* v = qkv + int64_t{b} * seq * ld + 2 * channels;
    const float* dy = dout + int64_t{b} * seq * channels;
    const float* p = att + int64_t{b} * heads * tt;
    float* dp = dp_all + int64_t{b} * heads * tt;
    float* dv = dqkv + int64_t{b} * seq * ld + 2 * channels;
    if (!CheckBlas(BatchedGemm(H(blas_), false, true, seq, seq, hs, 1.0f, dy, channels, hs, v, ld,
                               hs, dp, seq, tt, heads),
                   "AttentionBackward (dP)") ||
        !CheckBlas(BatchedGemm(H(blas_), true, false, seq, hs, seq, 1.0f, p, seq, tt, dy, channels,
                               hs, dv, ld, hs, heads),
                   "AttentionBackward (dV)")) {
      return;
    }
  }
  const int64_t rows = int64_t{batch} * heads * seq;
  CausalSoftmaxBackwardKernel<<<RowBlocks(rows), kThreads, 0, S(stream_)>>>(dp_all, att, rows, seq);
  if (!CheckLaunch("AttentionBackward (softmax)")) return;
  for (int b = 0; b < batch; ++b) {
    const float* q = qkv + int64_t{b} * seq * ld;
    const float* dp = dp_all + int64_t{b} * heads * tt;
    float* dq = dqkv + int64_t{b} * seq * ld;
    if (!CheckBlas(BatchedGemm(H(blas_), false, false, seq, hs, seq, scale, dp, seq, tt,
                               q + channels, ld, hs, dq, ld, hs, heads),
                   "AttentionBackward (dQ)") ||
        !CheckBlas(BatchedGemm(H(blas_), true, false, seq, hs, seq, scale, dp, seq, tt, q, ld, hs,
                               dq + channels, ld, hs, heads),
                   "AttentionBackward (dK)")) {
      return;
    }
  }
}

void CudaBackend::Gelu(float* out, const float* x, int64_t n) {
  if (n == 0 || !Ready()) return;
  GeluKernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(out, x, n);
  CheckLaunch("Gelu");
}

void CudaBackend::GeluBackward(float* dx, const float* x, const float* dout, int64_t n) {
  if (n == 0 || !Ready()) return;
  GeluBackwardKernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(dx, x, dout, n);
  CheckLaunch("GeluBackward");
}

void CudaBackend::CrossEntropyForwardBackward(float* logits, float* losses, const int32_t* targets,
                                              int n, int vocab, float scale) {
  if (n == 0 || !Ready()) return;
  CrossEntropyKernel<<<n, kThreads, 0, S(stream_)>>>(logits, losses, targets, vocab, scale);
  CheckLaunch("CrossEntropyForwardBackward");
}

}  // namespace pith::cuda
