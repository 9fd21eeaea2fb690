// CpuBackend: memory, dense ops and the loss. The MoE ops live in cpu_backend_moe.cc.
#include "worker/compute/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/buffer.h"
#include "worker/compute/blas.h"
#include "worker/compute/cpu_kernels.h"

namespace pith::compute {
namespace {

constexpr float kLayerNormEps = 1e-5f;

// Rows per ParallelFor chunk for row-wise loops over `channels` columns: ~16k elements.
int64_t RowGrain(int channels) { return std::max<int64_t>(1, 16384 / std::max(1, channels)); }

}  // namespace

std::optional<std::string> BetterBlasCore() {
  const std::string picked = openblas_get_corename();
  // The pre-AVX2 cores OpenBLAS falls back to.
  for (const char* old : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom",
                          "Sandybridge", "Katmai", "Coppermine", "Northwood", "Banias"}) {
    if (picked != old) continue;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      return "SkylakeX";
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
    return std::nullopt;
  }
  return std::nullopt;
}

std::string BlasCoreName() { return openblas_get_corename(); }

void ReexecWithBetterBlasCore(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::optional<std::string> core = BetterBlasCore();
  if (!core) return;
  // The program's own path, not /proc/self/exe: the process keeps its name.
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return;
  path[n] = '\0';
  ::setenv("OPENBLAS_CORETYPE", core->c_str(), 1);
  ::execv(path, argv);
  ::unsetenv("OPENBLAS_CORETYPE");  // the exec failed: go on with the kernels we have
}

CpuBackend::CpuBackend(int threads) : pool_(threads) { openblas_set_num_threads(pool_.size()); }

CpuBackend::~CpuBackend() = default;

absl::StatusOr<DeviceBuffer> CpuBackend::Allocate(size_t bytes) {
  if (bytes == 0) return DeviceBuffer(this, nullptr, 0);
  const size_t rounded = (bytes + Buffer::kAlignment - 1) / Buffer::kAlignment * Buffer::kAlignment;
  void* p = std::aligned_alloc(Buffer::kAlignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: cannot allocate ", bytes, " bytes"));
  }
  std::memset(p, 0, rounded);
  return DeviceBuffer(this, p, bytes);
}

void CpuBackend::Free(void* ptr, size_t) { std::free(ptr); }

absl::Status CpuBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

void CpuBackend::Zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

float* CpuBackend::FloatScratch(size_t n) {
  if (float_scratch_.size() < n) float_scratch_.resize(n);
  return float_scratch_.data();
}

int64_t* CpuBackend::IntScratch(size_t n) {
  if (int_scratch_.size() < n) int_scratch_.resize(n);
  return int_scratch_.data();
}

void CpuBackend::Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                      int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // BLAS leaves C untouched for k = 0 only when beta = 1; make beta = 0 mean "written".
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[int64_t{i} * ldc + j] *= beta;
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void CpuBackend::AddBias(float* out, const float* bias, int m, int n) {
  pool_.ParallelFor(m, RowGrain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + i * n;
      for (int j = 0; j < n; ++j) row[j] += bias[j];
    }
  });
}

void CpuBackend::BiasGrad(float* dbias, const float* dout, int m, int n) {
  // Column blocks in parallel; rows summed in order, so the result does not depend on the
  // thread count.
  pool_.ParallelFor(n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < m; ++i) {
      const float* row = dout + i * n;
      for (int64_t j = begin; j < end; ++j) dbias[j] += row[j];
    }
  });
}

void CpuBackend::Add(float* out, const float* a, const float* b, int64_t n) {
  pool_.ParallelFor(n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = a[i] + b[i];
  });
}

void CpuBackend::Embedding(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                           int batch, int seq, int channels) {
  pool_.ParallelFor(int64_t{batch} * seq, RowGrain(channels), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* te = wte + int64_t{tokens[i]} * channels;
      const float* pe = wpe + (i % seq) * channels;
      float* o = out + i * channels;
      for (int c = 0; c < channels; ++c) o[c] = te[c] + pe[c];
    }
  });
}

void CpuBackend::EmbeddingBackward(float* dwte, float* dwpe, const float* dout,
                                   const int32_t* tokens, int batch, int seq, int channels) {
  // Serial in token order: tokens repeat, and a fixed order keeps results reproducible.
  for (int64_t i = 0; i < int64_t{batch} * seq; ++i) {
    const float* d = dout + i * channels;
    float* te = dwte + int64_t{tokens[i]} * channels;
    float* pe = dwpe + (i % seq) * channels;
    for (int c = 0; c < channels; ++c) {
      te[c] += d[c];
      pe[c] += d[c];
    }
  }
}

void CpuBackend::LayerNorm(float* out, float* mean, float* rstd, const float* x, const float* w,
                           const float* b, int n, int channels) {
  pool_.ParallelFor(n, RowGrain(channels), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x + i * channels;
      double sum = 0;
      for (int c = 0; c < channels; ++c) sum += xi[c];
      const double m = sum / channels;
      double var = 0;
      for (int c = 0; c < channels; ++c) var += (xi[c] - m) * (xi[c] - m);
      const float s = static_cast<float>(1.0 / std::sqrt(var / channels + kLayerNormEps));
      const float mf = static_cast<float>(m);
      float* o = out + i * channels;
      for (int c = 0; c < channels; ++c) o[c] = (xi[c] - mf) * s * w[c] + b[c];
      mean[i] = mf;
      rstd[i] = s;
    }
  });
}

void CpuBackend::LayerNormBackward(float* dx, float* dw, float* db, const float* dout,
                                   const float* x, const float* w, const float* mean,
                                   const float* rstd, int n, int channels) {
  pool_.ParallelFor(n, RowGrain(channels), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x + i * channels;
      const float* di = dout + i * channels;
      double dnorm_mean = 0, dnorm_norm_mean = 0;
      for (int c = 0; c < channels; ++c) {
        const double norm = (xi[c] - mean[i]) * rstd[i];
        const double dnorm = double{w[c]} * di[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean /= channels;
      dnorm_norm_mean /= channels;
      float* dxi = dx + i * channels;
      for (int c = 0; c < channels; ++c) {
        const double norm = (xi[c] - mean[i]) * rstd[i];
        const double dnorm = double{w[c]} * di[c];
        dxi[c] += static_cast<float>((dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[i]);
      }
    }
  });
  pool_.ParallelFor(channels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = x + i * channels;
      const float* di = dout + i * channels;
      for (int64_t c = begin; c < end; ++c) {
        dw[c] += (xi[c] - mean[i]) * rstd[i] * di[c];
        db[c] += di[c];
      }
    }
  });
}

namespace {

void Sgemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
           const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

// NOTE: attention is B*H small products; they run one (batch, head) per pool thread with
// single-threaded GEMMs, which beats multi-threading each tiny GEMM.
void CpuBackend::Attention(float* out, float* att, const float* qkv, int batch, int seq,
                           int channels, int heads) {
  const int hs = channels / heads;
  const int ld = 3 * channels;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  BlasThreads single(1);
  pool_.ParallelFor(int64_t{batch} * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* q = qkv + b * seq * ld + h * hs;
      const float* k = q + channels;
      const float* v = q + 2 * channels;
      float* p = att + bh * seq * seq;
      Sgemm(false, true, seq, seq, hs, scale, q, ld, k, ld, 0.0f, p, seq);
      // Causal softmax per row; the masked entries become exact zeros.
      for (int t = 0; t < seq; ++t) {
        float* row = p + int64_t{t} * seq;
        float mx = row[0];
        for (int j = 1; j <= t; ++j) mx = std::max(mx, row[j]);
        double sum = 0;
        for (int j = 0; j <= t; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int j = 0; j <= t; ++j) row[j] *= inv;
        for (int j = t + 1; j < seq; ++j) row[j] = 0.0f;
      }
      Sgemm(false, false, seq, hs, seq, 1.0f, p, seq, v, ld, 0.0f,
            out + b * seq * channels + h * hs, channels);
    }
  });
}

void CpuBackend::AttentionBackward(float* dqkv, const float* dout, const float* qkv,
                                   const float* att, int batch, int seq, int channels, int heads) {
  const int hs = channels / heads;
  const int ld = 3 * channels;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* scratch = FloatScratch(static_cast<size_t>(batch) * heads * seq * seq);
  BlasThreads single(1);
  pool_.ParallelFor(int64_t{batch} * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const int64_t base = b * seq * ld + h * hs;
      const float* q = qkv + base;
      const float* k = q + channels;
      const float* v = q + 2 * channels;
      float* dq = dqkv + base;
      float* dk = dq + channels;
      float* dv = dq + 2 * channels;
      const float* p = att + bh * seq * seq;
      float* dp = scratch + bh * seq * seq;
      const float* dy = dout + b * seq * channels + h * hs;
      Sgemm(false, true, seq, seq, hs, 1.0f, dy, channels, v, ld, 0.0f, dp, seq);  // dP = dY V^T
      Sgemm(true, false, seq, hs, seq, 1.0f, p, seq, dy, channels, 0.0f, dv, ld);  // dV = P^T dY
      // dS = P * (dP - rowsum(dP * P)); zero above the diagonal because P is.
      for (int t = 0; t < seq; ++t) {
        float* drow = dp + int64_t{t} * seq;
        const float* prow = p + int64_t{t} * seq;
        double dot = 0;
        for (int j = 0; j <= t; ++j) dot += double{drow[j]} * prow[j];
        const float d = static_cast<float>(dot);
        for (int j = 0; j <= t; ++j) drow[j] = prow[j] * (drow[j] - d);
        for (int j = t + 1; j < seq; ++j) drow[j] = 0.0f;
      }
      Sgemm(false, false, seq, hs, seq, scale, dp, seq, k, ld, 0.0f, dq, ld);  // dQ = dS K
      Sgemm(true, false, seq, hs, seq, scale, dp, seq, q, ld, 0.0f, dk, ld);   // dK = dS^T Q
    }
  });
}

void CpuBackend::Gelu(float* out, const float* x, int64_t n) {
  pool_.ParallelFor(n, 16384, [&](int64_t begin, int64_t end) { GeluRange(out, x, begin, end); });
}

void CpuBackend::GeluBackward(float* dx, const float* x, const float* dout, int64_t n) {
  pool_.ParallelFor(
      n, 16384, [&](int64_t begin, int64_t end) { GeluBackwardRange(dx, x, dout, begin, end); });
}

void CpuBackend::CrossEntropyForwardBackward(float* logits, float* losses, const int32_t* targets,
                                             int n, int vocab, float scale) {
  pool_.ParallelFor(n, RowGrain(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = logits + i * vocab;
      float mx = row[0];
      for (int j = 1; j < vocab; ++j) mx = std::max(mx, row[j]);
      double sum = 0;
      for (int j = 0; j < vocab; ++j) sum += std::exp(double{row[j]} - mx);
      const double lse = mx + std::log(sum);
      losses[i] = static_cast<float>(lse - row[targets[i]]);
      for (int j = 0; j < vocab; ++j) {
        row[j] = static_cast<float>(std::exp(double{row[j]} - lse)) * scale;
      }
      row[targets[i]] -= scale;
    }
  });
}

double CpuBackend::SumOfSquares(const float* x, int64_t n) {
  // Fixed chunks summed in order: the same result for any thread count.
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  double* partial = reinterpret_cast<double*>(FloatScratch(2 * static_cast<size_t>(chunks) + 2));
  pool_.ParallelFor(chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double sum = 0;
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i)
        sum += double{x[i]} * x[i];
      partial[c] = sum;
    }
  });
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

void CpuBackend::Scale(float* x, float s, int64_t n) {
  pool_.ParallelFor(n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) x[i] *= s;
  });
}

void CpuBackend::AdamW(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  const AdamWConstants k = MakeAdamWConstants(lr, beta1, beta2, eps, weight_decay, step);
  pool_.ParallelFor(
      n, 16384, [&](int64_t begin, int64_t end) { AdamWRange(param, grad, m, v, begin, end, k); });
}

}  // namespace pith::compute
