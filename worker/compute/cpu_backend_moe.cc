// CpuBackend: routing, token permutation, the grouped expert FFN and the router backward.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "worker/compute/blas.h"
#include "worker/compute/cpu_backend.h"
#include "worker/compute/cpu_kernels.h"

namespace pith::compute {

void CpuBackend::Route(const float* logits, int n, int experts, const RouterConfig& config,
                       const RoutingBuffers& out) {
  const int k = config.top_k;
  // Softmax, logsumexp and top-k per token (independent, so in parallel).
  pool_.ParallelFor(n, std::max(1, 4096 / experts), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = logits + t * experts;
      float* p = out.probs + t * experts;
      float mx = r[0];
      for (int e = 1; e < experts; ++e) mx = std::max(mx, r[e]);
      double sum = 0;
      for (int e = 0; e < experts; ++e) sum += std::exp(double{r[e]} - mx);
      const double lse = mx + std::log(sum);
      out.lse[t] = static_cast<float>(lse);
      for (int e = 0; e < experts; ++e) p[e] = static_cast<float>(std::exp(double{r[e]} - lse));
      // Top-k by probability; a strict '>' keeps the lower id on ties.
      int32_t* chosen = out.expert + t * k;
      float* gate = out.gate + t * k;
      double gate_sum = 0;
      for (int s = 0; s < k; ++s) {
        int best = -1;
        for (int e = 0; e < experts; ++e) {
          bool taken = false;
          for (int j = 0; j < s; ++j) taken |= chosen[j] == e;
          if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        chosen[s] = best;
        gate[s] = p[best];
        gate_sum += p[best];
      }
      if (config.renormalize) {
        for (int s = 0; s < k; ++s) gate[s] = static_cast<float>(gate[s] / gate_sum);
      }
    }
  });

  // Statistics, capacity and the bucket layout: serial, in slot-major order.
  for (int e = 0; e < experts; ++e) {
    out.routed[e] = 0;
    out.prob_sum[e] = 0;
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int e = 0; e < experts; ++e) out.prob_sum[e] += out.probs[t * experts + e];
  }
  const int64_t capacity =
      config.capacity_factor > 0
          ? static_cast<int64_t>(std::ceil(config.capacity_factor * k * n / experts))
          : int64_t{n} * k;
  int64_t* kept = IntScratch(experts);
  std::fill(kept, kept + experts, 0);
  for (int s = 0; s < k; ++s) {
    for (int64_t t = 0; t < n; ++t) {
      const int e = out.expert[t * k + s];
      ++out.routed[e];
      // Mark kept assignments with 0 for now; rows are numbered once the offsets are known.
      out.row[t * k + s] = kept[e] < capacity ? (++kept[e], 0) : -1;
    }
  }
  out.offsets[0] = 0;
  for (int e = 0; e < experts; ++e) out.offsets[e + 1] = out.offsets[e] + kept[e];
  std::copy(out.offsets, out.offsets + experts, kept);  // kept[e] becomes the next free row
  for (int s = 0; s < k; ++s) {
    for (int64_t t = 0; t < n; ++t) {
      int32_t& row = out.row[t * k + s];
      if (row < 0) continue;
      row = static_cast<int32_t>(kept[out.expert[t * k + s]]++);
      out.bucket_token[row] = static_cast<int32_t>(t);
    }
  }
}

void CpuBackend::Permute(float* bucket, const float* x, const int32_t* bucket_token, int64_t rows,
                         int channels) {
  pool_.ParallelFor(rows, std::max(1, 16384 / channels), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(bucket + r * channels, x + int64_t{bucket_token[r]} * channels,
                  sizeof(float) * channels);
    }
  });
}

void CpuBackend::ScatterRows(float* dst, const float* src, const int32_t* dst_row, int64_t rows,
                             int channels) {
  pool_.ParallelFor(rows, std::max(1, 16384 / channels), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(dst + int64_t{dst_row[r]} * channels, src + r * channels,
                  sizeof(float) * channels);
    }
  });
}

void CpuBackend::PermuteBackward(float* dx, const float* dbucket, const int32_t* row, int n,
                                 int top_k, int channels) {
  pool_.ParallelFor(n, std::max(1, 16384 / channels), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* d = dx + t * channels;
      for (int s = 0; s < top_k; ++s) {
        const int32_t r = row[t * top_k + s];
        if (r < 0) continue;
        const float* src = dbucket + int64_t{r} * channels;
        for (int c = 0; c < channels; ++c) d[c] += src[c];
      }
    }
  });
}

void CpuBackend::Combine(float* out, const float* y, const int32_t* row, const float* gate, int n,
                         int top_k, int channels) {
  pool_.ParallelFor(n, std::max(1, 16384 / channels), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = out + t * channels;
      std::fill(o, o + channels, 0.0f);
      for (int s = 0; s < top_k; ++s) {
        const int32_t r = row[t * top_k + s];
        if (r < 0) continue;
        const float g = gate[t * top_k + s];
        const float* yr = y + int64_t{r} * channels;
        for (int c = 0; c < channels; ++c) o[c] += g * yr[c];
      }
    }
  });
}

void CpuBackend::CombineBackward(float* dy, float* dgate, const float* dout, const float* y,
                                 const int32_t* row, const float* gate, int n, int top_k,
                                 int channels) {
  pool_.ParallelFor(n, std::max(1, 16384 / channels), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* d = dout + t * channels;
      for (int s = 0; s < top_k; ++s) {
        const int32_t r = row[t * top_k + s];
        if (r < 0) {
          dgate[t * top_k + s] = 0.0f;
          continue;
        }
        const float g = gate[t * top_k + s];
        const float* yr = y + int64_t{r} * channels;
        float* dyr = dy + int64_t{r} * channels;
        double dot = 0;
        for (int c = 0; c < channels; ++c) {
          dyr[c] = g * d[c];
          dot += double{d[c]} * yr[c];
        }
        dgate[t * top_k + s] = static_cast<float>(dot);
      }
    }
  });
}

namespace {

void AddBiasRows(float* out, const float* bias, int64_t rows, int n) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = out + i * n;
    for (int j = 0; j < n; ++j) row[j] += bias[j];
  }
}

void ColumnSums(float* dbias, const float* d, int64_t rows, int n) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = d + i * n;
    for (int j = 0; j < n; ++j) dbias[j] += row[j];
  }
}

void Sgemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
           float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

bool CpuBackend::ExpertsInParallel(const int64_t* offsets, int experts) const {
  // Many small buckets: one expert per thread at a time, single-threaded GEMMs, beat
  // multi-threaded GEMMs on each small bucket in turn.
  int nonempty = 0;
  for (int e = 0; e < experts; ++e) nonempty += offsets[e + 1] > offsets[e];
  return pool_.size() > 1 && nonempty >= 2 * pool_.size() &&
         offsets[experts] < int64_t{kParallelExpertRows} * nonempty;
}

void CpuBackend::ExpertForward(float* y, float* hpre, float* h, const float* x,
                               const int64_t* offsets, absl::Span<const ExpertWeights> experts,
                               int channels, int hidden) {
  const int num_experts = static_cast<int>(experts.size());
  auto one = [&](int e) {
    const int64_t begin = offsets[e];
    const int rows = static_cast<int>(offsets[e + 1] - begin);
    if (rows == 0) return;
    float* hp = hpre + begin * hidden;
    Sgemm(false, false, rows, hidden, channels, x + begin * channels, channels, experts[e].w1,
          hidden, 0.0f, hp, hidden);
    AddBiasRows(hp, experts[e].b1, rows, hidden);
    GeluRange(h, hpre, begin * hidden, (begin + rows) * hidden);
    float* ye = y + begin * channels;
    Sgemm(false, false, rows, channels, hidden, h + begin * hidden, hidden, experts[e].w2, channels,
          0.0f, ye, channels);
    AddBiasRows(ye, experts[e].b2, rows, channels);
  };
  if (ExpertsInParallel(offsets, num_experts)) {
    BlasThreads single(1);
    pool_.ParallelFor(num_experts, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) one(static_cast<int>(i));
    });
    return;
  }
  // Few large buckets: multi-threaded GEMMs, the element-wise work on the pool.
  for (int e = 0; e < num_experts; ++e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    float* hp = hpre + begin * hidden;
    Gemm(false, false, static_cast<int>(rows), hidden, channels, 1.0f, x + begin * channels,
         channels, experts[e].w1, hidden, 0.0f, hp, hidden);
    AddBias(hp, experts[e].b1, static_cast<int>(rows), hidden);
  }
  Gelu(h, hpre, offsets[num_experts] * hidden);
  for (int e = 0; e < num_experts; ++e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    float* ye = y + begin * channels;
    Gemm(false, false, static_cast<int>(rows), channels, hidden, 1.0f, h + begin * hidden, hidden,
         experts[e].w2, channels, 0.0f, ye, channels);
    AddBias(ye, experts[e].b2, static_cast<int>(rows), channels);
  }
}

void CpuBackend::ExpertBackward(float* dx, float* dh, absl::Span<const ExpertGrads> grads,
                                const float* dy, const float* x, const float* hpre, const float* h,
                                const int64_t* offsets, absl::Span<const ExpertWeights> experts,
                                int channels, int hidden) {
  const int num_experts = static_cast<int>(experts.size());
  // dH = dY W2^T; dW2 += H^T dY; db2 += sums of dY.
  auto second = [&](int e, bool threaded) {
    const int64_t begin = offsets[e];
    const int rows = static_cast<int>(offsets[e + 1] - begin);
    if (rows == 0) return;
    const float* dye = dy + begin * channels;
    Sgemm(false, true, rows, hidden, channels, dye, channels, experts[e].w2, channels, 0.0f,
          dh + begin * hidden, hidden);
    Sgemm(true, false, hidden, channels, rows, h + begin * hidden, hidden, dye, channels, 1.0f,
          grads[e].w2, channels);
    if (threaded) {
      BiasGrad(grads[e].b2, dye, rows, channels);
    } else {
      ColumnSums(grads[e].b2, dye, rows, channels);
    }
  };
  // dW1 += X^T dHpre; db1 += sums of dHpre; dX = dHpre W1^T.
  auto first = [&](int e, bool threaded) {
    const int64_t begin = offsets[e];
    const int rows = static_cast<int>(offsets[e + 1] - begin);
    if (rows == 0) return;
    const float* dhe = dh + begin * hidden;
    Sgemm(true, false, channels, hidden, rows, x + begin * channels, channels, dhe, hidden, 1.0f,
          grads[e].w1, hidden);
    if (threaded) {
      BiasGrad(grads[e].b1, dhe, rows, hidden);
    } else {
      ColumnSums(grads[e].b1, dhe, rows, hidden);
    }
    Sgemm(false, true, rows, channels, hidden, dhe, hidden, experts[e].w1, hidden, 0.0f,
          dx + begin * channels, channels);
  };
  if (ExpertsInParallel(offsets, num_experts)) {
    BlasThreads single(1);
    pool_.ParallelFor(num_experts, 1, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) {
        const int e = static_cast<int>(i);
        second(e, false);
        GeluBackwardRange(dh + offsets[e] * hidden, hpre + offsets[e] * hidden,
                          dh + offsets[e] * hidden, 0, (offsets[e + 1] - offsets[e]) * hidden);
        first(e, false);
      }
    });
    return;
  }
  for (int e = 0; e < num_experts; ++e) second(e, true);
  GeluBackward(dh, hpre, dh, offsets[num_experts] * hidden);
  for (int e = 0; e < num_experts; ++e) first(e, true);
}

void CpuBackend::RouteBackward(float* dlogits, const float* dgate, const RoutingBuffers& routing,
                               int n, int experts, const RouterConfig& config,
                               const RouterLossGrad& loss) {
  const int k = config.top_k;
  const double inv_global = 1.0 / static_cast<double>(loss.global_tokens);
  pool_.ParallelFor(n, std::max(1, 4096 / experts), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* p = routing.probs + t * experts;
      float* dr = dlogits + t * experts;
      // dL/dp: the aux loss touches every expert, the gates only the chosen ones.
      for (int e = 0; e < experts; ++e) {
        dr[e] = loss.aux_coef != 0
                    ? static_cast<float>(loss.aux_coef * experts * loss.global_f[e] * inv_global)
                    : 0.0f;
      }
      const int32_t* chosen = routing.expert + t * k;
      const float* dg = dgate + t * k;
      if (config.renormalize) {
        double sum = 0, weighted = 0;
        for (int s = 0; s < k; ++s) {
          sum += p[chosen[s]];
          weighted += double{dg[s]} * p[chosen[s]];
        }
        for (int s = 0; s < k; ++s) {
          dr[chosen[s]] += static_cast<float>(dg[s] / sum - weighted / (sum * sum));
        }
      } else {
        for (int s = 0; s < k; ++s) dr[chosen[s]] += dg[s];
      }
      // Through the softmax, then the z-loss on the logits directly.
      double dot = 0;
      for (int e = 0; e < experts; ++e) dot += double{dr[e]} * p[e];
      const double z = loss.z_coef * 2.0 * routing.lse[t] * inv_global;
      for (int e = 0; e < experts; ++e) {
        dr[e] = static_cast<float>(p[e] * (dr[e] - dot) + z * p[e]);
      }
    }
  });
}

}  // namespace pith::compute
