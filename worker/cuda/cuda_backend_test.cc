// Every CudaBackend op against the CPU backend on the same inputs: fp32 results within
// 1e-5 of the reference (relative to the reference's own scale: the two sum in different
// orders), integer routing outputs equal. Skipped without a CUDA device.
#include "worker/cuda/cuda_backend.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/cuda/cuda_test_support.h"

namespace pith::cuda {
namespace {

using compute::CpuBackend;
using compute::DeviceBuffer;
using testing_support::Bf16Vec;
using testing_support::ExpectClose;
using testing_support::Ints;
using testing_support::kRelative;
using testing_support::Random;
using testing_support::ToBf16;
using testing_support::Vec;

class CudaBackendTest : public testing_support::CudaTest {
 protected:
  void MoveRows(int channels);
};

// The token rows' gather and scatter between workers (Dispatch over NCCL): the CPU's bits,
// by float (37 channels) and by float4 (40).
TEST_F(CudaBackendTest, PermuteAndScatterRowsMoveRowsAsTheCpuDoes) {
  for (int kC : {37, 40}) {
    SCOPED_TRACE(testing::Message() << "channels " << kC);
    MoveRows(kC);
  }
}

void CudaBackendTest::MoveRows(int kC) {
  constexpr int kRows = 300, kOut = 512;
  const Vec src = Random(kRows * kC, 11);
  Ints to(kOut);
  for (int i = 0; i < kOut; ++i) to[i] = (i * 7919) % kOut;  // a permutation of 0..511
  to.resize(kRows);
  Vec dst = Random(kOut * kC, 12), want = dst;
  float* dst_dev = Up(dst);
  const int32_t* to_dev = Up(to);
  gpu_->ScatterRows(dst_dev, Up(src), to_dev, kRows, kC);
  cpu_.ScatterRows(want.data(), src.data(), to.data(), kRows, kC);
  EXPECT_EQ(Down(dst_dev, want.size()), want);
  Vec back(kRows * kC);
  float* back_dev = Up(back);
  gpu_->Permute(back_dev, dst_dev, to_dev, kRows, kC);
  EXPECT_EQ(Down(back_dev, back.size()), src);
  gpu_->ScatterRows(dst_dev, Up(src), to_dev, 0, kC);  // nothing to move: no launch
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

TEST_F(CudaBackendTest, GemmEveryTransposeAlphaBetaAndEmptyK) {
  const int m = 37, n = 29, k = 53;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      const Vec a = Random(m * k, 1 + ta), b = Random(k * n, 3 + tb);
      Vec c = Random(m * n, 5);
      const int lda = ta ? m : k, ldb = tb ? k : n;
      float* dc = Up(c);
      gpu_->Gemm(ta, tb, m, n, k, 0.5f, Up(a), lda, Up(b), ldb, 0.25f, dc, n);
      cpu_.Gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 0.25f, c.data(), n);
      ExpectClose("gemm", Down(dc, c.size()), c);
    }
  }
  // Padded leading dimensions: a [m, k] block of a wider matrix, c inside a wider one.
  {
    const int lda = k + 5, ldb = n + 3, ldc = n + 7;
    const Vec a = Random(m * lda, 7), b = Random(k * ldb, 8);
    Vec c = Random(m * ldc, 9);
    float* dc = Up(c);
    gpu_->Gemm(false, false, m, n, k, 1.0f, Up(a), lda, Up(b), ldb, 1.0f, dc, ldc);
    cpu_.Gemm(false, false, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, c.data(), ldc);
    ExpectClose("gemm padded", Down(dc, c.size()), c);
  }
  Vec c = Random(m * n, 6);
  float* dc = Up(c);
  gpu_->Gemm(false, false, m, n, 0, 1.0f, nullptr, 1, nullptr, n, 0.0f, dc, n);
  EXPECT_EQ(Down(dc, c.size()), Vec(c.size(), 0.0f));
}

TEST_F(CudaBackendTest, BiasAddScaleAndSumOfSquares) {
  const int m = 300, n = 70;
  Vec out = Random(m * n, 1), bias = Random(n, 2), dbias = Random(n, 3);
  const Vec dout = Random(m * n, 4), other = Random(m * n, 5);
  float *dout_dev = Up(out), *dbias_dev = Up(dbias), *sum_dev = Up(out);
  gpu_->AddBias(dout_dev, Up(bias), m, n);
  gpu_->BiasGrad(dbias_dev, Up(dout), m, n);
  gpu_->Add(sum_dev, sum_dev, Up(other), int64_t{m} * n);
  gpu_->Scale(sum_dev, 0.5f, int64_t{m} * n);
  Vec sum = out;
  cpu_.AddBias(out.data(), bias.data(), m, n);
  cpu_.BiasGrad(dbias.data(), dout.data(), m, n);
  cpu_.Add(sum.data(), sum.data(), other.data(), int64_t{m} * n);
  cpu_.Scale(sum.data(), 0.5f, int64_t{m} * n);
  ExpectClose("add_bias", Down(dout_dev, out.size()), out);
  ExpectClose("bias_grad", Down(dbias_dev, n), dbias);
  ExpectClose("add_scale", Down(sum_dev, sum.size()), sum);
  const Vec big = Random(1 << 20, 9);
  EXPECT_NEAR(gpu_->SumOfSquares(Up(big), big.size()), cpu_.SumOfSquares(big.data(), big.size()),
              1e-9 * cpu_.SumOfSquares(big.data(), big.size()));
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

TEST_F(CudaBackendTest, EmbeddingAndBackward) {
  const int B = 3, T = 7, C = 40, V = 11;
  Ints tokens(B * T);
  for (int i = 0; i < B * T; ++i) tokens[i] = (i * 5) % V;  // repeats on purpose
  const Vec wte = Random(V * C, 1), wpe = Random(T * C, 2), dout = Random(B * T * C, 3);
  Vec out(B * T * C), dwte = Random(V * C, 4), dwpe = Random(T * C, 5);
  int32_t* tok = Up(tokens);
  float *out_dev = Up(out), *dwte_dev = Up(dwte), *dwpe_dev = Up(dwpe);
  gpu_->Embedding(out_dev, tok, Up(wte), Up(wpe), B, T, C);
  gpu_->EmbeddingBackward(dwte_dev, dwpe_dev, Up(dout), tok, B, T, C);
  cpu_.Embedding(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  cpu_.EmbeddingBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  ExpectClose("embedding", Down(out_dev, out.size()), out);
  ExpectClose("dwte", Down(dwte_dev, dwte.size()), dwte);
  ExpectClose("dwpe", Down(dwpe_dev, dwpe.size()), dwpe);
}

TEST_F(CudaBackendTest, LayerNormAndBackward) {
  for (int C : {24, 96, 1000}) {
    const int N = 67;
    const Vec x = Random(N * C, 1, 3.0f), w = Random(C, 2), b = Random(C, 3);
    const Vec dout = Random(N * C, 4);
    Vec out(N * C), mean(N), rstd(N), dx = Random(N * C, 5), dw = Random(C, 6), db = Random(C, 7);
    float *out_dev = Up(out), *mean_dev = Up(mean), *rstd_dev = Up(rstd);
    float *dx_dev = Up(dx), *dw_dev = Up(dw), *db_dev = Up(db);
    const float *x_dev = Up(x), *w_dev = Up(w);
    gpu_->LayerNorm(out_dev, mean_dev, rstd_dev, x_dev, w_dev, Up(b), N, C);
    gpu_->LayerNormBackward(dx_dev, dw_dev, db_dev, Up(dout), x_dev, w_dev, mean_dev, rstd_dev, N,
                            C);
    cpu_.LayerNorm(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    cpu_.LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                           mean.data(), rstd.data(), N, C);
    ExpectClose("layernorm", Down(out_dev, out.size()), out);
    ExpectClose("mean", Down(mean_dev, N), mean);
    ExpectClose("rstd", Down(rstd_dev, N), rstd);
    ExpectClose("ln dx", Down(dx_dev, dx.size()), dx);
    ExpectClose("ln dw", Down(dw_dev, C), dw);
    ExpectClose("ln db", Down(db_dev, C), db);
  }
}

TEST_F(CudaBackendTest, CausalAttentionAndBackward) {
  const int B = 2, T = 45, C = 48, H = 4;
  const Vec qkv = Random(B * T * 3 * C, 1), dout = Random(B * T * C, 2);
  Vec out(B * T * C), att(B * H * T * T), dqkv(B * T * 3 * C);
  float *out_dev = Up(out), *att_dev = Up(att), *dqkv_dev = Up(dqkv);
  const float* qkv_dev = Up(qkv);
  gpu_->Attention(out_dev, att_dev, qkv_dev, B, T, C, H);
  gpu_->AttentionBackward(dqkv_dev, Up(dout), qkv_dev, att_dev, B, T, C, H);
  cpu_.Attention(out.data(), att.data(), qkv.data(), B, T, C, H);
  cpu_.AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);
  ExpectClose("attention", Down(out_dev, out.size()), out);
  const Vec att_gpu = Down(att_dev, att.size());
  ExpectClose("att", att_gpu, att);
  int nonzero_above = 0;  // the causal mask: exact zeros above the diagonal
  for (int bh = 0; bh < B * H; ++bh) {
    for (int t = 0; t < T; ++t) {
      for (int j = t + 1; j < T; ++j)
        nonzero_above += att_gpu[(int64_t{bh} * T + t) * T + j] != 0.0f;
    }
  }
  EXPECT_EQ(nonzero_above, 0);
  ExpectClose("dqkv", Down(dqkv_dev, dqkv.size()), dqkv);
}

TEST_F(CudaBackendTest, GeluAndCrossEntropy) {
  const int64_t n = 5000;
  const Vec x = Random(n, 1, 3.0f), dout = Random(n, 2);
  Vec out(n), dx(n);
  float *out_dev = Up(out), *dx_dev = Up(dx);
  const float* x_dev = Up(x);
  gpu_->Gelu(out_dev, x_dev, n);
  gpu_->GeluBackward(dx_dev, x_dev, Up(dout), n);
  cpu_.Gelu(out.data(), x.data(), n);
  cpu_.GeluBackward(dx.data(), x.data(), dout.data(), n);
  ExpectClose("gelu", Down(out_dev, n), out);
  ExpectClose("gelu dx", Down(dx_dev, n), dx);

  const int N = 33, V = 3001;
  Vec logits = Random(N * V, 3, 4.0f), losses(N);
  Ints targets(N);
  for (int i = 0; i < N; ++i) targets[i] = (i * 97) % V;
  float *logits_dev = Up(logits), *losses_dev = Up(losses);
  gpu_->CrossEntropyForwardBackward(logits_dev, losses_dev, Up(targets), N, V, 0.125f);
  cpu_.CrossEntropyForwardBackward(logits.data(), losses.data(), targets.data(), N, V, 0.125f);
  ExpectClose("ce losses", Down(losses_dev, N), losses);
  ExpectClose("ce dlogits", Down(logits_dev, logits.size()), logits);
}

TEST_F(CudaBackendTest, AdamW) {
  const int64_t n = 100003;
  Vec p = Random(n, 1), m = Random(n, 2, 0.1f), v = Random(n, 3, 0.1f);
  for (float& x : v) x = std::fabs(x);
  const Vec g = Random(n, 4);
  float *p_dev = Up(p), *m_dev = Up(m), *v_dev = Up(v);
  gpu_->AdamW(p_dev, Up(g), m_dev, v_dev, n, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7);
  cpu_.AdamW(p.data(), g.data(), m.data(), v.data(), n, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7);
  ExpectClose("adamw p", Down(p_dev, n), p);
  ExpectClose("adamw m", Down(m_dev, n), m);
  ExpectClose("adamw v", Down(v_dev, n), v);
}

// Routes N tokens on both backends; the integer outputs must agree exactly.
struct Routed {
  Vec probs, lse, gate;
  Ints expert, row, bucket_token;
  std::vector<int64_t> offsets, routed;
  std::vector<double> prob_sum;
  compute::RoutingBuffers Buffers() {
    return {probs.data(),        lse.data(),     expert.data(), gate.data(),    row.data(),
            bucket_token.data(), offsets.data(), routed.data(), prob_sum.data()};
  }
};

Routed MakeRouted(int N, int E, int k) {
  Routed r;
  r.probs.assign(N * E, 0);
  r.lse.assign(N, 0);
  r.gate.assign(N * k, 0);
  r.expert.assign(N * k, 0);
  r.row.assign(N * k, 0);
  r.bucket_token.assign(N * k, 0);
  r.offsets.assign(E + 1, 0);
  r.routed.assign(E, 0);
  r.prob_sum.assign(E, 0);
  return r;
}

// The MoE block's ops on the CUDA backend against the CPU's; outputs that come out of a
// matrix product within `product_rel` (kRelative in fp32; bf16's rounding otherwise),
// the rest within kRelative or equal.
class CudaMoeTest : public CudaBackendTest {
 protected:
  void MoeBlock(double product_rel);
  // r's buffers, the device outputs on the device (offsets, routed and prob_sum stay host).
  compute::RoutingBuffers OnDevice(Routed& r) {
    compute::RoutingBuffers dev = r.Buffers();
    dev.probs = Up(r.probs);
    dev.lse = Up(r.lse);
    dev.expert = Up(r.expert);
    dev.gate = Up(r.gate);
    dev.row = Up(r.row);
    dev.bucket_token = Up(r.bucket_token);
    return dev;
  }
};

TEST_F(CudaMoeTest, ForwardAndBackward) { MoeBlock(kRelative); }

// bf16 inputs to every expert product: within 5e-2 of the fp32 reference (each input
// rounds by up to 2^-9; a wrong operand would be off by O(1)).
TEST_F(CudaMoeTest, ForwardAndBackwardInBf16) {
  ASSERT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kBf16).ok());
  MoeBlock(5e-2);
  // The same with the fan-outs' launches spread over host threads.
  gpu_->set_launch_threads(4);
  EXPECT_EQ(gpu_->launch_threads(), 4);
  MoeBlock(5e-2);
}

// Routing at a size whose bucket layout spans many of the device's tiles (1024
// assignments each; the last one ends in a partial warp), with and without capacity
// drops, then the row ops that follow it by float4 (40 channels) and by float (42):
// integers equal, sums within kRelative.
TEST_F(CudaMoeTest, RoutingAcrossManyTilesAndTheRowOpsAfterIt) {
  const int N = 3001, E = 128, k = 8;
  Vec logits = Random(N * E, 7, 2.0f);
  for (int t = 0; t < N; ++t) logits[t * E + t % 3] += 2.5f;  // three crowded experts
  for (double capacity : {0.9, 0.0}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    const compute::RouterConfig config{k, capacity, true};
    Routed want = MakeRouted(N, E, k), got = MakeRouted(N, E, k);
    cpu_.Route(logits.data(), N, E, config, want.Buffers());
    compute::RoutingBuffers dev = OnDevice(got);
    gpu_->Route(Up(logits), N, E, config, dev);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    EXPECT_EQ(Down(dev.expert, N * k), want.expert);
    EXPECT_EQ(Down(dev.row, N * k), want.row);
    EXPECT_EQ(got.offsets, want.offsets);
    EXPECT_EQ(got.routed, want.routed);
    const int64_t A = want.offsets[E];
    EXPECT_EQ(capacity > 0, A < int64_t{N} * k);  // the crowded experts drop some
    EXPECT_EQ(Down(dev.bucket_token, A),
              Ints(want.bucket_token.begin(), want.bucket_token.begin() + A));
    for (int C : {40, 42}) {
      SCOPED_TRACE(testing::Message() << "channels " << C);
      const Vec x = Random(N * C, 8), y = Random(A * C, 9), dout = Random(N * C, 10);
      const Vec dxperm = Random(A * C, 11);
      Vec xperm(A * C), out(N * C), dy(A * C), dgate(N * k), dx = Random(N * C, 12);
      float *xperm_dev = Up(xperm), *out_dev = Up(out), *dy_dev = Up(dy);
      float *dgate_dev = Up(dgate), *dx_dev = Up(dx);
      const float* y_dev = Up(y);
      gpu_->Permute(xperm_dev, Up(x), dev.bucket_token, A, C);
      gpu_->Combine(out_dev, y_dev, dev.row, dev.gate, N, k, C);
      gpu_->CombineBackward(dy_dev, dgate_dev, Up(dout), y_dev, dev.row, dev.gate, N, k, C);
      gpu_->PermuteBackward(dx_dev, Up(dxperm), dev.row, N, k, C);
      cpu_.Permute(xperm.data(), x.data(), want.bucket_token.data(), A, C);
      cpu_.Combine(out.data(), y.data(), want.row.data(), want.gate.data(), N, k, C);
      cpu_.CombineBackward(dy.data(), dgate.data(), dout.data(), y.data(), want.row.data(),
                           want.gate.data(), N, k, C);
      cpu_.PermuteBackward(dx.data(), dxperm.data(), want.row.data(), N, k, C);
      EXPECT_EQ(Down(xperm_dev, xperm.size()), xperm);
      ExpectClose("combine", Down(out_dev, out.size()), out);
      ExpectClose("dy", Down(dy_dev, dy.size()), dy);
      ExpectClose("dgate", Down(dgate_dev, dgate.size()), dgate);
      ExpectClose("dx", Down(dx_dev, dx.size()), dx);
    }
  }
}

// A token whose logits are NaN (a diverged step), or hold an infinity, still gets k
// distinct valid experts, the CPU's (0 to k - 1), so the layout stays inside its buffers
// and matches; the step's loss is NaN and the job says so.
TEST_F(CudaMoeTest, NanLogitsStillRouteToValidExperts) {
  const int N = 64, E = 16, k = 4;
  Vec logits = Random(N * E, 13);
  for (int e = 0; e < E; ++e) logits[5 * E + e] = std::nanf("");
  logits[9 * E + 3] = std::numeric_limits<float>::infinity();
  const compute::RouterConfig config{k, 0.0, true};
  Routed want = MakeRouted(N, E, k), got = MakeRouted(N, E, k);
  cpu_.Route(logits.data(), N, E, config, want.Buffers());
  compute::RoutingBuffers dev = OnDevice(got);
  gpu_->Route(Up(logits), N, E, config, dev);
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
  const Ints experts = Down(dev.expert, N * k);
  EXPECT_EQ(experts, want.expert);
  EXPECT_EQ(Down(dev.row, N * k), want.row);
  EXPECT_EQ(got.offsets, want.offsets);
  for (int t : {5, 9}) {
    for (int s = 0; s < k; ++s) EXPECT_EQ(experts[t * k + s], s) << "token " << t;
  }
  for (int t = 0; t < N; ++t) {
    std::vector<bool> seen(E, false);
    for (int s = 0; s < k; ++s) {
      const int e = experts[t * k + s];
      ASSERT_TRUE(e >= 0 && e < E) << "token " << t << " slot " << s << ": expert " << e;
      EXPECT_FALSE(seen[e]) << "token " << t << " takes expert " << e << " twice";
      seen[e] = true;
    }
  }
  EXPECT_EQ(got.offsets[E], int64_t{N} * k);
  for (int32_t t : Down(dev.bucket_token, N * k)) ASSERT_TRUE(t >= 0 && t < N) << t;
}

void CudaMoeTest::MoeBlock(double product_rel) {
  struct Case {
    int experts, top_k;
    double capacity;
    bool renormalize;
    int hidden;  // 54: biases off 16-byte alignment, so the bias passes go by float
    int channels = 40, tokens = 96;
  };
  // E = 64: lanes of the routing warp scan several experts each. 97 tokens: the routing's
  // last warp is partial. C 42 with F 56: odd experts' b1 sits 8 bytes off 16 while the
  // rows are float4-sized, so the bias and gelu pass must see the bias pointers.
  for (const Case& c : {Case{8, 2, 1.0, true, 56}, Case{8, 2, 0.0, false, 54},
                        Case{5, 5, 0.0, true, 56}, Case{16, 1, 0.5, true, 54},
                        Case{64, 4, 1.25, true, 56}, Case{8, 2, 1.0, true, 56, 42, 97}}) {
    SCOPED_TRACE(testing::Message()
                 << "E=" << c.experts << " k=" << c.top_k << " capacity=" << c.capacity
                 << " F=" << c.hidden << " C=" << c.channels << " N=" << c.tokens);
    const int N = c.tokens, C = c.channels, F = c.hidden, E = c.experts, k = c.top_k;
    compute::RouterConfig config{k, c.capacity, c.renormalize};
    // Skewed logits leave some experts with empty buckets.
    Vec logits = Random(N * E, 1, 2.0f);
    for (int t = 0; t < N; ++t) logits[t * E] += 3.0f;
    Routed want = MakeRouted(N, E, k), got = MakeRouted(N, E, k);
    cpu_.Route(logits.data(), N, E, config, want.Buffers());
    compute::RoutingBuffers dev = OnDevice(got);
    gpu_->Route(Up(logits), N, E, config, dev);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    ExpectClose("probs", Down(dev.probs, N * E), want.probs);
    ExpectClose("lse", Down(dev.lse, N), want.lse);
    ExpectClose("gate", Down(dev.gate, N * k), want.gate);
    EXPECT_EQ(Down(dev.expert, N * k), want.expert);
    EXPECT_EQ(Down(dev.row, N * k), want.row);
    EXPECT_EQ(got.offsets, want.offsets);
    EXPECT_EQ(got.routed, want.routed);
    const int64_t A = want.offsets[E];
    EXPECT_EQ(Down(dev.bucket_token, A),
              Ints(want.bucket_token.begin(), want.bucket_token.begin() + A));
    for (int e = 0; e < E; ++e) EXPECT_NEAR(got.prob_sum[e], want.prob_sum[e], 1e-9 * N);

    // Permute, the experts, combine; then every backward.
    const Vec x = Random(N * C, 2), weights = Random(E * (2 * C * F + F + C), 3, 0.2f);
    Vec grads = Random(weights.size(), 4, 0.1f);
    const float* w_dev = Up(weights);
    float* g_dev = Up(grads);
    std::vector<compute::ExpertWeights> w_cpu, w_gpu;
    std::vector<compute::ExpertGrads> g_cpu, g_gpu;
    for (int e = 0; e < E; ++e) {
      const int64_t o = int64_t{e} * (2 * C * F + F + C);
      auto at = [&](auto* base) {
        return std::array{base + o, base + o + C * F, base + o + C * F + F,
                          base + o + 2 * C * F + F};
      };
      const auto pc = at(weights.data()), pg = at(w_dev);
      const auto gc = at(grads.data()), gg = at(g_dev);
      w_cpu.push_back({pc[0], pc[1], pc[2], pc[3]});
      w_gpu.push_back({pg[0], pg[1], pg[2], pg[3]});
      g_cpu.push_back({gc[0], gc[1], gc[2], gc[3]});
      g_gpu.push_back({gg[0], gg[1], gg[2], gg[3]});
    }
    Vec xperm(A * C), y(A * C), hpre(A * F), h(A * F), out(N * C);
    float *xperm_dev = Up(xperm), *y_dev = Up(y), *hpre_dev = Up(hpre), *h_dev = Up(h);
    float* out_dev = Up(out);
    gpu_->Permute(xperm_dev, Up(x), dev.bucket_token, A, C);
    gpu_->ExpertForward(y_dev, hpre_dev, h_dev, xperm_dev, got.offsets.data(), w_gpu, C, F);
    gpu_->Combine(out_dev, y_dev, dev.row, dev.gate, N, k, C);
    cpu_.Permute(xperm.data(), x.data(), want.bucket_token.data(), A, C);
    cpu_.ExpertForward(y.data(), hpre.data(), h.data(), xperm.data(), want.offsets.data(), w_cpu, C,
                       F);
    cpu_.Combine(out.data(), y.data(), want.row.data(), want.gate.data(), N, k, C);
    ExpectClose("xperm", Down(xperm_dev, xperm.size()), xperm);
    ExpectClose("hpre", Down(hpre_dev, hpre.size()), hpre, product_rel);
    ExpectClose("expert y", Down(y_dev, y.size()), y, product_rel);
    ExpectClose("combine", Down(out_dev, out.size()), out, product_rel);

    const Vec dout = Random(N * C, 5);
    Vec dy(A * C), dgate(N * k), dh(A * F), dxperm(A * C), dx = Random(N * C, 6), dlogits(N * E);
    float *dy_dev = Up(dy), *dgate_dev = Up(dgate), *dh_dev = Up(dh), *dxperm_dev = Up(dxperm);
    float *dx_dev = Up(dx), *dlogits_dev = Up(dlogits);
    std::vector<double> global_f(E);
    for (int e = 0; e < E; ++e) global_f[e] = double(want.routed[e]) / (double(N) * k);
    compute::RouterLossGrad loss{0.01, 0.001, N, global_f.data()};
    gpu_->CombineBackward(dy_dev, dgate_dev, Up(dout), y_dev, dev.row, dev.gate, N, k, C);
    gpu_->ExpertBackward(dxperm_dev, dh_dev, g_gpu, dy_dev, xperm_dev, hpre_dev, h_dev,
                         got.offsets.data(), w_gpu, C, F);
    gpu_->PermuteBackward(dx_dev, dxperm_dev, dev.row, N, k, C);
    gpu_->RouteBackward(dlogits_dev, dgate_dev, dev, N, E, config, loss);
    cpu_.CombineBackward(dy.data(), dgate.data(), dout.data(), y.data(), want.row.data(),
                         want.gate.data(), N, k, C);
    cpu_.ExpertBackward(dxperm.data(), dh.data(), g_cpu, dy.data(), xperm.data(), hpre.data(),
                        h.data(), want.offsets.data(), w_cpu, C, F);
    cpu_.PermuteBackward(dx.data(), dxperm.data(), want.row.data(), N, k, C);
    cpu_.RouteBackward(dlogits.data(), dgate.data(), want.Buffers(), N, E, config, loss);
    ExpectClose("dy", Down(dy_dev, dy.size()), dy);
    ExpectClose("dgate", Down(dgate_dev, dgate.size()), dgate, product_rel);
    ExpectClose("dxperm", Down(dxperm_dev, dxperm.size()), dxperm, product_rel);
    ExpectClose("expert grads", Down(g_dev, grads.size()), grads, product_rel);
    ExpectClose("dx", Down(dx_dev, dx.size()), dx, product_rel);
    ExpectClose("dlogits", Down(dlogits_dev, dlogits.size()), dlogits, product_rel);
  }
}

// `v` rounded to bf16 (kept as floats) and its bf16 bits.
// The bf16 products against the CPU's fp32 product of the same (bf16-exact) inputs: fp32
// outputs within 1e-5 (bf16 x bf16 is exact in fp32, the sums are fp32), bf16 outputs
// within their rounding (2^-8 relative). Every transpose; one call of several problems
// fanned out; one product with k = 0 and beta 0 (zeroed).
TEST_F(CudaBackendTest, Bf16ProductsMatchTheFp32ProductOfTheirInputs) {
  const int m = 37, n = 29, k = 53;
  std::vector<CudaBackend::Bf16Gemm> problems;
  std::vector<Vec> want;
  std::vector<void*> outputs;
  std::vector<bool> fp32;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2, c_fp32 = t < 2;
    const Bf16Vec a = ToBf16(Random(m * k, 11 + t)), b = ToBf16(Random(k * n, 21 + t));
    const int lda = ta ? m : k, ldb = tb ? k : n;
    Vec c = c_fp32 ? Random(m * n, 31 + t) : Vec(m * n, 0.0f);
    const float beta = c_fp32 ? 1.0f : 0.0f;
    void* dc = c_fp32 ? static_cast<void*>(Up(c)) : static_cast<void*>(Up(ToBf16(c).bits));
    problems.push_back({ta, tb, m, n, k, Up(a.bits), lda, Up(b.bits), ldb, beta, dc, n, c_fp32});
    cpu_.Gemm(ta, tb, m, n, k, 1.0f, a.rounded.data(), lda, b.rounded.data(), ldb, beta, c.data(),
              n);
    want.push_back(c);
    outputs.push_back(dc);
    fp32.push_back(c_fp32);
  }
  Vec zeroed = Random(m * n, 41);
  problems.push_back({false, false, m, n, 0, nullptr, 1, nullptr, n, 0.0f, Up(zeroed), n, true});
  gpu_->FanOutGemmBf16(problems, "bf16 test");
  // The single product: problem 0's inputs, into a fresh fp32 output with beta 0.
  CudaBackend::Bf16Gemm single = problems[0];
  Vec alone = Random(m * n, 51);
  single.beta = 0.0f;
  single.c = Up(alone);
  gpu_->GemmBf16(single, "bf16 test (single)");
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "problem " << i);
    if (fp32[i]) {
      ExpectClose("bf16 -> fp32", Down(static_cast<float*>(outputs[i]), want[i].size()), want[i]);
    } else {
      Vec got;
      for (uint16_t b : Down(static_cast<uint16_t*>(outputs[i]), want[i].size())) {
        got.push_back(Bf16ToFloat(b));
      }
      ExpectClose("bf16 -> bf16", got, want[i], 1.0 / 128);
    }
  }
  EXPECT_EQ(Down(static_cast<float*>(problems.back().c), zeroed.size()), Vec(zeroed.size(), 0.0f));
  // want[0] is C0 + P; the single product is P alone.
  const Vec c0 = Random(m * n, 31);
  Vec product(m * n);
  for (int r = 0; r < m * n; ++r) product[r] = want[0][r] - c0[r];
  ExpectClose("bf16 single", Down(static_cast<float*>(single.c), alone.size()), product, 1e-4);

  // cuBLAS's grouped call writes bf16 only: an fp32 output is an error naming the op.
  gpu_->GroupedGemmBf16({problems[0]}, "bf16 grouped test");
  EXPECT_NE(gpu_->Synchronize().message().find("bf16 grouped test"), absl::string_view::npos);
}

// The bf16 compute dtype: Gemm rounds both inputs to bf16 (nearest even) and accumulates
// in fp32, so it matches the CPU's fp32 product of the rounded inputs within 1e-5, for
// every transpose, padded leading dimensions, alpha and beta; GemmFp32 does not round.
TEST_F(CudaBackendTest, GemmInBf16RoundsItsInputs) {
  ASSERT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kBf16).ok());
  EXPECT_EQ(gpu_->compute_dtype(), ComputeDtype::kBf16);
  const int m = 37, n = 29, k = 53;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      const int lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
      const Vec a = Random((ta ? k : m) * lda, 31 + ta), b = Random((tb ? n : k) * ldb, 33 + tb);
      Vec c = Random(m * ldc, 35), exact = c;
      float *dc = Up(c), *dexact = Up(c);
      const float *da = Up(a), *db = Up(b);
      gpu_->Gemm(ta, tb, m, n, k, 0.5f, da, lda, db, ldb, 0.25f, dc, ldc);
      gpu_->GemmFp32(ta, tb, m, n, k, 0.5f, da, lda, db, ldb, 0.25f, dexact, ldc);
      cpu_.Gemm(ta, tb, m, n, k, 0.5f, ToBf16(a).rounded.data(), lda, ToBf16(b).rounded.data(), ldb,
                0.25f, c.data(), ldc);
      cpu_.Gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 0.25f, exact.data(), ldc);
      ExpectClose("bf16 gemm", Down(dc, c.size()), c);
      ExpectClose("GemmFp32 in bf16 mode", Down(dexact, exact.size()), exact);
    }
  }
  Vec c = Random(m * n, 6);
  float* dc = Up(c);
  gpu_->Gemm(false, false, m, n, 0, 1.0f, nullptr, 1, nullptr, n, 0.0f, dc, n);
  EXPECT_EQ(Down(dc, c.size()), Vec(c.size(), 0.0f));
  ASSERT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kFp32).ok());
  EXPECT_EQ(gpu_->compute_dtype(), ComputeDtype::kFp32);
}

TEST_F(CudaBackendTest, Bf16GroupedProductsMatch) {
  const int m = 64, n = 48, k = 32;
  std::vector<CudaBackend::Bf16Gemm> problems;
  std::vector<Vec> want;
  for (int e = 0; e < 3; ++e) {
    const Bf16Vec a = ToBf16(Random(m * k, 61 + e)), b = ToBf16(Random(k * n, 71 + e));
    Vec c(m * n, 0.0f);
    cpu_.Gemm(false, false, m, n, k, 1.0f, a.rounded.data(), k, b.rounded.data(), n, 0.0f, c.data(),
              n);
    problems.push_back({false, false, m, n, k, Up(a.bits), k, Up(b.bits), n, 0.0f,
                        Up(std::vector<uint16_t>(m * n)), n});
    want.push_back(c);
  }
  gpu_->GroupedGemmBf16(problems, "bf16 grouped");
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
  for (size_t i = 0; i < want.size(); ++i) {
    Vec got;
    for (uint16_t b : Down(static_cast<uint16_t*>(problems[i].c), want[i].size())) {
      got.push_back(Bf16ToFloat(b));
    }
    ExpectClose("grouped bf16", got, want[i], 1.0 / 128);
  }
}

// A bf16 job's experts from their bf16 weights blobs (common/bf16.h: the cluster worker's
// cache slots) compute what the same experts' fp32 master weights do in bf16 (the
// products round them to the same values), forward and backward; in fp32 such weights are
// refused, naming the op.
TEST_F(CudaBackendTest, Bf16WeightsBlobsComputeWhatTheirMasterDoes) {
  const int C = 64, F = 96, E = 3;
  const std::vector<int64_t> offsets = {0, 40, 40, 100};  // an empty bucket too
  const int64_t A = offsets[E], floats = 2 * C * F + F + C;
  const Bf16ExpertLayout at(C, F);
  const Vec master = Random(E * floats, 31, 0.2f);
  std::vector<uint8_t> blobs(E * at.bytes);
  for (int e = 0; e < E; ++e)
    PackExpertBf16(master.data() + e * floats, C, F, &blobs[e * at.bytes]);
  const float* master_dev = Up(master);
  const uint8_t* blobs_dev = Up(blobs);
  std::vector<compute::ExpertWeights> fp32, bf16;
  for (int e = 0; e < E; ++e) {
    fp32.push_back(compute::ExpertWeightsAt(master_dev + e * floats, false, C, F));
    bf16.push_back(compute::ExpertWeightsAt(blobs_dev + e * at.bytes, true, C, F));
  }
  ASSERT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kBf16).ok());
  const Vec x = Random(A * C, 32), dy = Random(A * C, 33);
  const float *x_dev = Up(x), *dy_dev = Up(dy);
  struct Run {
    Vec y, hpre, dx, grads;
  };
  auto run = [&](const std::vector<compute::ExpertWeights>& w) {
    float *y = Up(Vec(A * C)), *hpre = Up(Vec(A * F)), *h = Up(Vec(A * F));
    float *dx = Up(Vec(A * C)), *dh = Up(Vec(A * F)), *g = Up(Vec(E * floats));
    std::vector<compute::ExpertGrads> grads;
    for (int e = 0; e < E; ++e) {
      float* b = g + e * floats;
      grads.push_back({b, b + C * F, b + C * F + F, b + 2 * C * F + F});
    }
    gpu_->ExpertForward(y, hpre, h, x_dev, offsets.data(), w, C, F);
    gpu_->ExpertBackward(dx, dh, grads, dy_dev, x_dev, hpre, h, offsets.data(), w, C, F);
    EXPECT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    return Run{Down(y, A * C), Down(hpre, A * F), Down(dx, A * C), Down(g, E * floats)};
  };
  const Run want = run(fp32), got = run(bf16);
  ExpectClose("y", got.y, want.y);
  ExpectClose("hpre", got.hpre, want.hpre);
  ExpectClose("dx", got.dx, want.dx);
  ExpectClose("expert grads", got.grads, want.grads);
  ASSERT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kFp32).ok());
  float* y = Up(Vec(A * C));
  gpu_->ExpertForward(y, Up(Vec(A * F)), Up(Vec(A * F)), x_dev, offsets.data(), bf16, C, F);
  EXPECT_NE(gpu_->status().message().find("bf16 expert weights"), std::string::npos)
      << gpu_->status();
}

// device_bytes counts the buffers and the slot mirrors while they live; a slot mirror's
// upload lands in its device slot, and its download brings back what the backend's ops
// wrote there before the slot's Release (a gradient pool's way down).
TEST_F(CudaBackendTest, DeviceBytesCountBuffersAndSlotMirrors) {
  const uint64_t base = gpu_->device_bytes();
  constexpr size_t kSlot = 1 << 20;
  {
    auto buffer = gpu_->Allocate(kSlot);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_EQ(gpu_->device_bytes(), base + kSlot);
    std::vector<uint8_t> host(4 * kSlot);
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 7 + 3);
    auto mirror = gpu_->MakeSlotMirror(kSlot, 4, host.data(), host.size());
    ASSERT_TRUE(mirror.ok()) << mirror.status();
    EXPECT_EQ((*mirror)->slots(), 4);
    EXPECT_EQ(gpu_->device_bytes(), base + 5 * kSlot);
    ASSERT_TRUE((*mirror)->Upload(1, host.data() + 2 * kSlot, kSlot).ok());
    auto slot = (*mirror)->Use(1);
    ASSERT_TRUE(slot.ok()) << slot.status();
    ASSERT_TRUE((*mirror)->Release(1).ok());
    ASSERT_TRUE((*mirror)->WaitCopies().ok());
    EXPECT_EQ((*mirror)->uploads(), 1u);
    const std::vector<uint8_t> landed = Down(static_cast<const uint8_t*>(*slot), kSlot);
    EXPECT_TRUE(std::equal(landed.begin(), landed.end(), host.begin() + 2 * kSlot));

    // Down: ops write slot 2, the download lands in host slot 3 once waited for.
    std::vector<float> ones(kSlot / sizeof(float), 1.0f);
    auto out = (*mirror)->Use(2);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(gpu_->CopyToDevice(*out, ones.data(), kSlot).ok());
    gpu_->Scale(static_cast<float*>(*out), 3.0f, static_cast<int64_t>(ones.size()));
    ASSERT_TRUE((*mirror)->Release(2).ok());
    ASSERT_TRUE((*mirror)->Download(2, host.data() + 3 * kSlot, kSlot).ok());
    ASSERT_TRUE((*mirror)->WaitSlot(2).ok());
    EXPECT_EQ((*mirror)->downloads(), 1u);
    std::vector<float> down(ones.size());
    std::memcpy(down.data(), host.data() + 3 * kSlot, kSlot);
    EXPECT_EQ(down, std::vector<float>(ones.size(), 3.0f));
  }
  EXPECT_EQ(gpu_->device_bytes(), base);
}

TEST_F(CudaBackendTest, ErrorsNameTheirOpAndStick) {
  Vec a(16, 1.0f);
  float* d = Up(a);
  gpu_->Gemm(false, false, 4, 4, 4, 1.0f, d, /*lda=*/1, d, 4, 0.0f, d, 4);  // lda < k
  const absl::Status st = gpu_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("Gemm"), absl::string_view::npos) << st;
  gpu_->Add(d, d, d, 16);  // skipped: the backend stays failed
  EXPECT_EQ(gpu_->CopyToHost(a.data(), d, 4).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(gpu_->Allocate(size_t{1} << 62).status().code(), absl::StatusCode::kInternal);
}

TEST_F(CudaBackendTest, AllocationBeyondTheDeviceIsResourceExhausted) {
  absl::StatusOr<DeviceBuffer> huge = gpu_->Allocate(size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_TRUE(gpu_->Synchronize().ok());  // not sticky
}

}  // namespace
}  // namespace pith::cuda
