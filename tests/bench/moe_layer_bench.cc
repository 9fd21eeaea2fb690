// MoE layer forward + backward on the CPU backend (router, top-k, permute, grouped expert
// FFN, combine, and every backward), against cblas_sgemm on the same GEMM shapes in the
// same run. The anchor runs the six expert GEMMs of fwd+bwd as if every assignment went
// to one expert (the best case for sgemm) plus the router GEMMs; the ratio is
// MoE time / anchor time, so 1.25 means 80% of the sgemm FLOP rate.
//
// Shapes (argument = index): 0: tokens 4096, d 256, f 1024, E 16, k 2;
//                            1: tokens 4096, d 256, f 512,  E 64, k 2.
#include <cblas.h>

#include <random>
#include <vector>

#include "anchor_reporter.h"
#include "worker/compute/cpu_backend.h"

namespace pith {
namespace {

struct Shape {
  int tokens, d, f, experts, k;
};
constexpr Shape kShapes[] = {{4096, 256, 1024, 16, 2}, {4096, 256, 512, 64, 2}};

double GemmFlops(const Shape& s) {
  const double a = static_cast<double>(s.tokens) * s.k;
  return 6.0 * 2.0 * a * s.d * s.f + 3.0 * 2.0 * s.tokens * s.d * s.experts;
}

std::vector<float> Random(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void Report(benchmark::State& state, const Shape& s) {
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(s.tokens),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(GemmFlops(s) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AnchorSgemm(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int a = s.tokens * s.k;
  std::mt19937 rng(1);
  const size_t as = static_cast<size_t>(a), ds = static_cast<size_t>(s.d),
               fs = static_cast<size_t>(s.f);
  std::vector<float> x = Random(as * ds, rng, 1.0f), w1 = Random(ds * fs, rng, 0.05f),
                     w2 = Random(fs * ds, rng, 0.05f), h(as * fs), y(as * ds), dh(as * fs),
                     dw1(w1.size()), dw2(w2.size()), dx(x.size()),
                     wr = Random(ds * s.experts, rng, 0.05f),
                     r(static_cast<size_t>(s.tokens) * s.experts), dwr(wr.size());
  for (auto _ : state) {
    // Forward: h = x w1, y = h w2; backward: dh = dy w2^T, dw2 = h^T dy, dw1 = x^T dh,
    // dx = dh w1^T. Router: r = x wr, dx += dr wr^T, dwr = x^T dr.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, a, s.f, s.d, 1, x.data(), s.d, w1.data(),
                s.f, 0, h.data(), s.f);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, a, s.d, s.f, 1, h.data(), s.f, w2.data(),
                s.d, 0, y.data(), s.d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a, s.f, s.d, 1, y.data(), s.d, w2.data(),
                s.d, 0, dh.data(), s.f);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.f, s.d, a, 1, h.data(), s.f, y.data(),
                s.d, 0, dw2.data(), s.d);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.d, s.f, a, 1, x.data(), s.d, dh.data(),
                s.f, 0, dw1.data(), s.f);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a, s.d, s.f, 1, dh.data(), s.f, w1.data(),
                s.f, 0, dx.data(), s.d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.tokens, s.experts, s.d, 1, x.data(),
                s.d, wr.data(), s.experts, 0, r.data(), s.experts);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.tokens, s.d, s.experts, 1, r.data(),
                s.experts, wr.data(), s.experts, 1, dx.data(), s.d);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.d, s.experts, s.tokens, 1, x.data(), s.d,
                r.data(), s.experts, 0, dwr.data(), s.experts);
    benchmark::DoNotOptimize(dx.data());
  }
  Report(state, s);
}

void BM_MoeLayer(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int n = s.tokens, c = s.d, f = s.f, e = s.experts, k = s.k;
  const int64_t a = int64_t{n} * k;
  compute::CpuBackend backend;
  std::mt19937 rng(2);
  std::vector<float> x = Random(static_cast<size_t>(n) * c, rng, 1.0f),
                     wr = Random(static_cast<size_t>(c) * e, rng, 0.05f),
                     dout = Random(static_cast<size_t>(n) * c, rng, 1e-3f);
  std::vector<float> weights = Random(static_cast<size_t>(e) * (2 * c * f + f + c), rng, 0.05f);
  std::vector<float> grads(weights.size());
  std::vector<compute::ExpertWeights> ew;
  std::vector<compute::ExpertGrads> eg;
  for (int i = 0; i < e; ++i) {
    float* p = weights.data() + static_cast<size_t>(i) * (2 * c * f + f + c);
    float* g = grads.data() + static_cast<size_t>(i) * (2 * c * f + f + c);
    ew.push_back({p, p + c * f, p + c * f + f, p + 2 * c * f + f});
    eg.push_back({g, g + c * f, g + c * f + f, g + 2 * c * f + f});
  }
  std::vector<float> logits(static_cast<size_t>(n) * e), probs(logits.size()), lse(n), gate(a),
      xperm(a * c), hpre(a * f), h(a * f), y(a * c), out(static_cast<size_t>(n) * c), dy(a * c),
      dgate(a), dh(a * f), dxperm(a * c), dx(static_cast<size_t>(n) * c), dlogits(logits.size()),
      dwr(wr.size());
  std::vector<int32_t> expert(a), row(a), bucket_token(a);
  std::vector<int64_t> offsets(e + 1), routed(e);
  std::vector<double> prob_sum(e), global_f(e);
  const compute::RoutingBuffers rb{probs.data(),   lse.data(),    expert.data(),
                                   gate.data(),    row.data(),    bucket_token.data(),
                                   offsets.data(), routed.data(), prob_sum.data()};
  const compute::RouterConfig config{.top_k = k, .capacity_factor = 0, .renormalize = true};
  for (auto _ : state) {
    backend.Gemm(false, false, n, e, c, 1.0f, x.data(), c, wr.data(), e, 0.0f, logits.data(), e);
    backend.Route(logits.data(), n, e, config, rb);
    backend.Permute(xperm.data(), x.data(), bucket_token.data(), offsets[e], c);
    backend.ExpertForward(y.data(), hpre.data(), h.data(), xperm.data(), offsets.data(), ew, c, f);
    backend.Combine(out.data(), y.data(), row.data(), gate.data(), n, k, c);
    for (int i = 0; i < e; ++i) global_f[i] = double(routed[i]) / double(a);
    backend.CombineBackward(dy.data(), dgate.data(), dout.data(), y.data(), row.data(), gate.data(),
                            n, k, c);
    backend.ExpertBackward(dxperm.data(), dh.data(), eg, dy.data(), xperm.data(), hpre.data(),
                           h.data(), offsets.data(), ew, c, f);
    backend.Zero(dx.data(), dx.size() * sizeof(float));
    backend.PermuteBackward(dx.data(), dxperm.data(), row.data(), n, k, c);
    backend.RouteBackward(dlogits.data(), dgate.data(), rb, n, e, config,
                          {0.01, 0.001, n, global_f.data()});
    backend.Gemm(false, true, n, c, e, 1.0f, dlogits.data(), e, wr.data(), e, 1.0f, dx.data(), c);
    backend.Gemm(true, false, c, e, n, 1.0f, x.data(), c, dlogits.data(), e, 0.0f, dwr.data(), e);
    benchmark::DoNotOptimize(dx.data());
  }
  Report(state, s);
}

BENCHMARK(BM_AnchorSgemm)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3);
BENCHMARK(BM_MoeLayer)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3);

}  // namespace
}  // namespace pith

PITH_BENCHMARK_MAIN();
