// Finite-difference checks of every CpuBackend op's backward, and the routing rules of
// DESIGN §3 (top-k ties, renormalization, slot-major capacity, dropless, k = E).
#include "worker/compute/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace pith::compute {
namespace {

using Vec = std::vector<float>;

Vec Random(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  Vec v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double{a[i]} * b[i];
  return s;
}

// Compares `grad` (the analytic d loss / d x) with central differences of `loss` at up to
// `samples` entries of x. `valid` may veto a sample (a routing decision flipped).
void CheckGradient(const char* what, Vec& x, const Vec& grad, const std::function<double()>& loss,
                   int samples = 48, float eps = 1e-2f, double rtol = 2e-2, double atol = 2e-3,
                   const std::function<bool()>& valid = nullptr) {
  ASSERT_EQ(x.size(), grad.size());
  std::mt19937 rng(123);
  int checked = 0;
  for (int s = 0; s < samples; ++s) {
    const size_t i = x.size() <= static_cast<size_t>(samples) ? s % x.size() : rng() % x.size();
    const float saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    const bool up_valid = !valid || valid();
    x[i] = saved - eps;
    const double down = loss();
    const bool down_valid = !valid || valid();
    x[i] = saved;
    if (!up_valid || !down_valid) {
      if (getenv("PITH_DEBUG_FD")) fprintf(stderr, "%s[%zu] routing changed\n", what, i);
      continue;
    }
    const double numeric = (up - down) / (2.0 * eps);
    EXPECT_NEAR(grad[i], numeric,
                atol + rtol * std::max(std::fabs(numeric), std::fabs(double{grad[i]})))
        << what << "[" << i << "]";
    ++checked;
  }
  EXPECT_GT(checked, samples / 2) << what << ": too few samples checked";
}

class CpuBackendTest : public ::testing::Test {
 protected:
  CpuBackend backend_{2};
  std::mt19937 rng_{42};
};

TEST_F(CpuBackendTest, LinearGemmBiasAndBackward) {
  const int M = 5, K = 7, N = 3;
  Vec x = Random(M * K, rng_), w = Random(K * N, rng_), b = Random(N, rng_),
      r = Random(M * N, rng_);
  auto loss = [&] {
    Vec y(M * N);
    backend_.Gemm(false, false, M, N, K, 1.0f, x.data(), K, w.data(), N, 0.0f, y.data(), N);
    backend_.AddBias(y.data(), b.data(), M, N);
    return Dot(y, r);
  };
  Vec dx(M * K), dw(K * N), db(N);
  backend_.Gemm(false, true, M, K, N, 1.0f, r.data(), N, w.data(), N, 0.0f, dx.data(), K);
  backend_.Gemm(true, false, K, N, M, 1.0f, x.data(), K, r.data(), N, 0.0f, dw.data(), N);
  backend_.BiasGrad(db.data(), r.data(), M, N);
  CheckGradient("dx", x, dx, loss);
  CheckGradient("dw", w, dw, loss);
  CheckGradient("db", b, db, loss);
}

TEST_F(CpuBackendTest, EmbeddingBackward) {
  const int B = 2, T = 3, C = 4, V = 5;
  std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 3};
  Vec wte = Random(V * C, rng_), wpe = Random(T * C, rng_), r = Random(B * T * C, rng_);
  auto loss = [&] {
    Vec y(B * T * C);
    backend_.Embedding(y.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return Dot(y, r);
  };
  Vec dwte(V * C), dwpe(T * C);
  backend_.EmbeddingBackward(dwte.data(), dwpe.data(), r.data(), tokens.data(), B, T, C);
  CheckGradient("dwte", wte, dwte, loss);
  CheckGradient("dwpe", wpe, dwpe, loss);
}

TEST_F(CpuBackendTest, LayerNormBackward) {
  const int N = 6, C = 10;
  Vec x = Random(N * C, rng_), w = Random(C, rng_), b = Random(C, rng_), r = Random(N * C, rng_);
  Vec y(N * C), mean(N), rstd(N);
  auto loss = [&] {
    backend_.LayerNorm(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return Dot(y, r);
  };
  loss();
  // A normalized row has mean 0 and variance 1 before the affine part.
  Vec ones(C, 1.0f), zeros(C, 0.0f), plain(N * C);
  backend_.LayerNorm(plain.data(), mean.data(), rstd.data(), x.data(), ones.data(), zeros.data(), N,
                     C);
  double m = 0, v = 0;
  for (int c = 0; c < C; ++c) m += plain[c];
  for (int c = 0; c < C; ++c) v += plain[c] * plain[c];
  EXPECT_NEAR(m / C, 0.0, 1e-6);
  EXPECT_NEAR(v / C, 1.0, 1e-3);

  loss();
  Vec dx(N * C), dw(C), db(C);
  backend_.LayerNormBackward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(),
                             mean.data(), rstd.data(), N, C);
  CheckGradient("dx", x, dx, loss);
  CheckGradient("dw", w, dw, loss);
  CheckGradient("db", b, db, loss);
}

TEST_F(CpuBackendTest, CausalAttentionBackward) {
  const int B = 2, T = 5, C = 8, H = 2;
  Vec qkv = Random(B * T * 3 * C, rng_), r = Random(B * T * C, rng_);
  Vec y(B * T * C), att(B * H * T * T);
  auto loss = [&] {
    backend_.Attention(y.data(), att.data(), qkv.data(), B, T, C, H);
    return Dot(y, r);
  };
  loss();
  // Causal: row t attends to positions <= t only, and each row sums to one.
  for (int bh = 0; bh < B * H; ++bh) {
    for (int t = 0; t < T; ++t) {
      double sum = 0;
      for (int j = 0; j < T; ++j) {
        const float p = att[(bh * T + t) * T + j];
        if (j > t) {
          EXPECT_EQ(p, 0.0f);
        }
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
  // The first position attends only to itself: its output is its own v.
  for (int c = 0; c < C; ++c) EXPECT_NEAR(y[c], qkv[2 * C + c], 1e-6);
  Vec dqkv(qkv.size());
  backend_.AttentionBackward(dqkv.data(), r.data(), qkv.data(), att.data(), B, T, C, H);
  CheckGradient("dqkv", qkv, dqkv, loss, 96);
}

TEST_F(CpuBackendTest, GeluTanhValuesAndBackward) {
  Vec x = {-3.0f, -1.0f, -0.1f, 0.0f, 0.5f, 2.0f, 6.0f};
  Vec y(x.size());
  backend_.Gelu(y.data(), x.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double want = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(y[i], want, 1e-6);
  }
  Vec r = Random(x.size(), rng_);
  auto loss = [&] {
    backend_.Gelu(y.data(), x.data(), x.size());
    return Dot(y, r);
  };
  Vec dx(x.size());
  backend_.GeluBackward(dx.data(), x.data(), r.data(), x.size());
  CheckGradient("dx", x, dx, loss, 7, 1e-3f);
}

TEST_F(CpuBackendTest, CrossEntropyForwardBackward) {
  const int N = 4, V = 9;
  Vec logits = Random(N * V, rng_, 2.0f);
  std::vector<int32_t> targets = {0, 8, 3, 3};
  const float scale = 1.0f / N;
  auto loss = [&] {
    Vec l = logits, losses(N);
    backend_.CrossEntropyForwardBackward(l.data(), losses.data(), targets.data(), N, V, scale);
    return std::accumulate(losses.begin(), losses.end(), 0.0) * scale;
  };
  // Reference value in double.
  double want = 0;
  for (int i = 0; i < N; ++i) {
    double sum = 0;
    for (int j = 0; j < V; ++j) sum += std::exp(double{logits[i * V + j]});
    want += std::log(sum) - logits[i * V + targets[i]];
  }
  EXPECT_NEAR(loss(), want / N, 1e-6);
  Vec d = logits, losses(N);
  backend_.CrossEntropyForwardBackward(d.data(), losses.data(), targets.data(), N, V, scale);
  CheckGradient("dlogits", logits, d, loss, 36, 1e-2f, 1e-2, 1e-4);
}

TEST_F(CpuBackendTest, AdamWMatchesTheFormula) {
  Vec p = {0.5f, -1.0f, 2.0f}, g = {0.1f, -0.2f, 0.3f}, m = {0.01f, 0.0f, -0.02f},
      v = {0.001f, 0.002f, 0.0f};
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  const int64_t step = 3;
  Vec want = p;
  for (int i = 0; i < 3; ++i) {
    double pp = p[i] * (1.0 - lr * wd);
    const double mm = b1 * m[i] + (1 - b1) * g[i];
    const double vv = b2 * v[i] + (1 - b2) * g[i] * g[i];
    pp -= lr / (1 - std::pow(b1, step)) * mm /
          (std::sqrt(vv) / std::sqrt(1 - std::pow(b2, step)) + eps);
    want[i] = static_cast<float>(pp);
  }
  backend_.AdamW(p.data(), g.data(), m.data(), v.data(), 3, lr, b1, b2, eps, wd, step);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(p[i], want[i], 1e-6) << i;
  Vec big(100000, 0.5f);
  EXPECT_NEAR(backend_.SumOfSquares(big.data(), big.size()), 25000.0, 1e-6);
  backend_.Scale(big.data(), 2.0f, big.size());
  EXPECT_EQ(big[99999], 1.0f);
}

// The vectorized update rounds once per operation, in the order written, like this scalar
// loop (this file is built for the baseline ISA: no fused multiply-add): the same bits
// whichever build of the kernel runs.
TEST_F(CpuBackendTest, AdamWGivesTheScalarLoopsBits) {
  const int64_t n = 100003;  // a tail past every vector width
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Vec p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    g[i] = 0.01f * normal(rng);
    m[i] = 0.001f * normal(rng);
    v[i] = 1e-5f * std::abs(normal(rng));
  }
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  const int64_t step = 17;
  Vec want_p = p, want_m = m, want_v = v;
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(double{b1}, double{step})));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double{b2}, double{step})));
  const float decay = 1.0f - lr * wd;
  for (int64_t i = 0; i < n; ++i) {
    float x = want_p[i] * decay;
    want_m[i] = b1 * want_m[i] + (1.0f - b1) * g[i];
    want_v[i] = b2 * want_v[i] + (1.0f - b2) * g[i] * g[i];
    x -= step_size * want_m[i] / (std::sqrt(want_v[i]) / bc2_sqrt + eps);
    want_p[i] = x;
  }
  backend_.AdamW(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, step);
  EXPECT_EQ(std::memcmp(p.data(), want_p.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m.data(), want_m.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(v.data(), want_v.data(), n * sizeof(float)), 0);
}

// Routing of N tokens over E experts; owns every buffer.
struct Routed {
  Routed(int n, int e, int k)
      : probs(n * e),
        lse(n),
        gate(n * k),
        expert(n * k),
        row(n * k),
        bucket_token(n * k),
        offsets(e + 1),
        routed(e),
        prob_sum(e) {}
  RoutingBuffers buffers() {
    return {probs.data(),        lse.data(),     expert.data(), gate.data(),    row.data(),
            bucket_token.data(), offsets.data(), routed.data(), prob_sum.data()};
  }
  Vec probs, lse, gate;
  std::vector<int32_t> expert, row, bucket_token;
  std::vector<int64_t> offsets, routed;
  std::vector<double> prob_sum;
};

// ScatterRows puts each row where its index says and leaves the other rows alone;
// Permute with the same index brings them back.
TEST_F(CpuBackendTest, ScatterRowsPutsRowsInPlaceAndPermuteGathersThem) {
  constexpr int kC = 3;
  const std::vector<float> src = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<int32_t> to = {4, 0, 2};
  std::vector<float> dst(5 * kC, -1.0f);
  backend_.ScatterRows(dst.data(), src.data(), to.data(), 3, kC);
  EXPECT_EQ(dst, std::vector<float>({4, 5, 6, -1, -1, -1, 7, 8, 9, -1, -1, -1, 1, 2, 3}));
  std::vector<float> back(3 * kC);
  backend_.Permute(back.data(), dst.data(), to.data(), 3, kC);
  EXPECT_EQ(back, src);
}

TEST_F(CpuBackendTest, RouteTopKTiesRenormalizationAndBuckets) {
  const int N = 3, E = 4, k = 2;
  // Token 0: experts 1 and 3 tie for first; token 1: all equal; token 2: clear order.
  Vec logits = {0.0f, 2.0f, 1.0f, 2.0f, 0.5f, 0.5f, 0.5f, 0.5f, 3.0f, -1.0f, 0.0f, 1.0f};
  Routed r(N, E, k);
  backend_.Route(logits.data(), N, E, {.top_k = k, .capacity_factor = 0, .renormalize = true},
                 r.buffers());
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 3, 0, 1, 0, 3}));
  EXPECT_NEAR(r.gate[0], 0.5f, 1e-6);
  EXPECT_NEAR(r.gate[1], 0.5f, 1e-6);
  EXPECT_NEAR(r.gate[4] + r.gate[5], 1.0f, 1e-6);
  EXPECT_GT(r.gate[4], r.gate[5]);
  EXPECT_NEAR(r.lse[1], 0.5 + std::log(4.0), 1e-6);
  // Dropless: every assignment kept; buckets by expert, slot-major within.
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 2, 4, 4, 6}));
  EXPECT_EQ(r.routed, (std::vector<int64_t>{2, 2, 0, 2}));
  // Expert 0: token 1 (slot 0) then token 2 (slot 0); expert 1: token 0 (s0), token 1 (s1);
  // expert 3: token 0 (s1), token 2 (s1).
  EXPECT_EQ(std::vector<int32_t>(r.bucket_token.begin(), r.bucket_token.begin() + 6),
            (std::vector<int32_t>{1, 2, 0, 1, 0, 2}));
  for (int t = 0; t < N; ++t) {
    for (int s = 0; s < k; ++s) EXPECT_EQ(r.bucket_token[r.row[t * k + s]], t);
  }

  // Without renormalization the gates are the probabilities.
  backend_.Route(logits.data(), N, E, {.top_k = k, .capacity_factor = 0, .renormalize = false},
                 r.buffers());
  EXPECT_NEAR(r.gate[4], r.probs[2 * E + 0], 1e-7);
}

TEST_F(CpuBackendTest, CapacityKeepsSlotZeroFirstAndDropsTheRest) {
  // All 8 tokens prefer expert 0, then expert 1. E = 4, k = 2, c = 1: C = ceil(1*2*8/4) = 4.
  const int N = 8, E = 4, k = 2;
  Vec logits(N * E);
  for (int t = 0; t < N; ++t) {
    logits[t * E + 0] = 5.0f;
    logits[t * E + 1] = 4.0f;
  }
  Routed r(N, E, k);
  backend_.Route(logits.data(), N, E, {.top_k = k, .capacity_factor = 1.0, .renormalize = true},
                 r.buffers());
  // Slot 0 of tokens 0..3 go to expert 0, tokens 4..7 are dropped there; their slot 1
  // (expert 1) is served for tokens 0..3 only — slot-major order.
  for (int t = 0; t < N; ++t) {
    EXPECT_EQ(r.row[t * k + 0] >= 0, t < 4) << t;
    EXPECT_EQ(r.row[t * k + 1] >= 0, t < 4) << t;
  }
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 4, 8, 8, 8}));
  EXPECT_EQ(r.routed, (std::vector<int64_t>{8, 8, 0, 0}));  // before drops

  // Capacity 1 per expert: c small enough that ceil gives 1.
  backend_.Route(logits.data(), N, E, {.top_k = k, .capacity_factor = 0.1, .renormalize = true},
                 r.buffers());
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 1, 2, 2, 2}));
  EXPECT_EQ(r.row[0], 0);   // token 0, slot 0 -> expert 0
  EXPECT_EQ(r.row[1], 1);   // token 0, slot 1 -> expert 1
  EXPECT_EQ(r.row[2], -1);  // token 1 dropped everywhere
  EXPECT_EQ(r.row[3], -1);

  // k = E: every expert chosen once per token, in probability order, gates summing to 1.
  Routed all(N, E, E);
  backend_.Route(logits.data(), N, E, {.top_k = E, .capacity_factor = 0, .renormalize = true},
                 all.buffers());
  for (int t = 0; t < N; ++t) {
    EXPECT_EQ(all.expert[t * E + 0], 0);
    EXPECT_EQ(all.expert[t * E + 1], 1);
    EXPECT_EQ(all.expert[t * E + 2], 2);  // tie between 2 and 3: lower id first
    EXPECT_EQ(all.expert[t * E + 3], 3);
    double sum = 0;
    for (int s = 0; s < E; ++s) sum += all.gate[t * E + s];
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
  EXPECT_EQ(all.offsets, (std::vector<int64_t>{0, 8, 16, 24, 32}));
}

// The whole MoE block: route -> permute -> expert FFN -> combine, plus the aux and z
// losses, against finite differences in the input, router and expert weights.
void CheckMoeBlock(CpuBackend& backend, double capacity_factor, int k) {
  std::mt19937 rng(13);
  const int N = 12, C = 6, E = 4, F = 5;
  const double aux_coef = 0.3, z_coef = 0.2;
  Vec h = Random(N * C, rng), wr = Random(C * E, rng, 0.5f), r = Random(N * C, rng);
  std::vector<Vec> w1, b1, w2, b2;
  for (int e = 0; e < E; ++e) {
    w1.push_back(Random(C * F, rng, 0.5f));
    b1.push_back(Random(F, rng, 0.1f));
    w2.push_back(Random(F * C, rng, 0.5f));
    b2.push_back(Random(C, rng, 0.1f));
  }
  const RouterConfig config{.top_k = k, .capacity_factor = capacity_factor, .renormalize = true};
  Routed route(N, E, k);
  Vec logits(N * E), xperm(N * k * C), hpre(N * k * F), act(N * k * F), y(N * k * C), out(N * C);
  auto weights = [&] {
    std::vector<ExpertWeights> w;
    for (int e = 0; e < E; ++e)
      w.push_back({w1[e].data(), b1[e].data(), w2[e].data(), b2[e].data()});
    return w;
  };
  std::vector<int32_t> reference_rows;
  auto loss = [&] {
    backend.Gemm(false, false, N, E, C, 1.0f, h.data(), C, wr.data(), E, 0.0f, logits.data(), E);
    backend.Route(logits.data(), N, E, config, route.buffers());
    backend.Permute(xperm.data(), h.data(), route.bucket_token.data(), route.offsets[E], C);
    std::vector<ExpertWeights> w = weights();
    backend.ExpertForward(y.data(), hpre.data(), act.data(), xperm.data(), route.offsets.data(), w,
                          C, F);
    backend.Combine(out.data(), y.data(), route.row.data(), route.gate.data(), N, k, C);
    double aux = 0, z = 0;
    for (int e = 0; e < E; ++e)
      aux += (double(route.routed[e]) / (N * k)) * (route.prob_sum[e] / N);
    for (int t = 0; t < N; ++t) z += double{route.lse[t]} * route.lse[t];
    return Dot(out, r) + aux_coef * E * aux + z_coef * z / N;
  };
  // Same routing decisions (experts and kept rows) as the point the gradient was taken at.
  auto same_routing = [&] { return route.row == reference_rows; };

  loss();
  reference_rows = route.row;
  ASSERT_LT(route.offsets[E], N * k);  // some drops when capacity applies, for the test's sake
  std::vector<double> f(E);
  for (int e = 0; e < E; ++e) f[e] = double(route.routed[e]) / (N * k);
  Vec dy(N * k * C), dgate(N * k), dh(N * k * F), dxperm(N * k * C), dlogits(N * E), dhin(N * C),
      dwr(C * E);
  std::vector<Vec> dw1(E, Vec(C * F)), db1(E, Vec(F)), dw2(E, Vec(F * C)), db2(E, Vec(C));
  std::vector<ExpertGrads> grads;
  for (int e = 0; e < E; ++e)
    grads.push_back({dw1[e].data(), db1[e].data(), dw2[e].data(), db2[e].data()});
  backend.CombineBackward(dy.data(), dgate.data(), r.data(), y.data(), route.row.data(),
                          route.gate.data(), N, k, C);
  std::vector<ExpertWeights> w = weights();
  backend.ExpertBackward(dxperm.data(), dh.data(), grads, dy.data(), xperm.data(), hpre.data(),
                         act.data(), route.offsets.data(), w, C, F);
  backend.PermuteBackward(dhin.data(), dxperm.data(), route.row.data(), N, k, C);
  backend.RouteBackward(dlogits.data(), dgate.data(), route.buffers(), N, E, config,
                        {aux_coef, z_coef, N, f.data()});
  backend.Gemm(false, true, N, C, E, 1.0f, dlogits.data(), E, wr.data(), E, 1.0f, dhin.data(), C);
  backend.Gemm(true, false, C, E, N, 1.0f, h.data(), C, dlogits.data(), E, 0.0f, dwr.data(), E);

  CheckGradient("dh", h, dhin, loss, 48, 3e-3f, 2e-2, 2e-3, same_routing);
  CheckGradient("dwr", wr, dwr, loss, 24, 1e-3f, 2e-2, 2e-3, same_routing);
  for (int e = 0; e < E; ++e) {
    if (route.offsets[e + 1] == route.offsets[e]) continue;
    CheckGradient("dw1", w1[e], dw1[e], loss, 12, 1e-2f, 2e-2, 2e-3, same_routing);
    CheckGradient("db1", b1[e], db1[e], loss, 5, 1e-2f, 2e-2, 2e-3, same_routing);
    CheckGradient("dw2", w2[e], dw2[e], loss, 12, 1e-2f, 2e-2, 2e-3, same_routing);
    CheckGradient("db2", b2[e], db2[e], loss, 6, 1e-2f, 2e-2, 2e-3, same_routing);
  }
}

TEST_F(CpuBackendTest, MoeBlockBackwardWithCapacity) { CheckMoeBlock(backend_, 1.0, 2); }
TEST_F(CpuBackendTest, MoeBlockBackwardTopOneCapacity) { CheckMoeBlock(backend_, 0.75, 1); }

}  // namespace
}  // namespace pith::compute
