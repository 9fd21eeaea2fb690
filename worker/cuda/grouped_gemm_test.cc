// CudaBackend's own grouped bf16 kernel (cuda_grouped.cu) against the CPU backend's fp32
// product of the same bf16-rounded inputs: every transpose, sizes that are not multiples
// of the tile (and a k that ends mid-step), padded leading dimensions, alpha and beta,
// fp32 and bf16 outputs, empty problems; the problems it does not take; and the expert
// FFN in the bf16 compute dtype, which must give the fan-out's results. Skipped without a
// CUDA device.
#include <vector>

#include "gtest/gtest.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_test_support.h"

namespace pith::cuda {
namespace {

using testing_support::Bf16Vec;
using testing_support::ExpectClose;
using testing_support::Random;
using testing_support::ToBf16;
using testing_support::Vec;

class GroupedGemmTest : public testing_support::CudaTest {};

struct Case {
  bool ta, tb;
  int m, n, k;
  int pad_a, pad_b, pad_c;  // added to the leading dimensions (multiples of 8 for a, b)
  float alpha, beta;
  bool c_fp32;
};

TEST_F(GroupedGemmTest, EveryTransposeShapeAndOutputMatchesTheCpu) {
  const std::vector<Case> cases = {
      {false, false, 200, 136, 64, 0, 0, 0, 1.0f, 0.0f, true},   // forward: x @ w1
      {false, true, 37, 264, 96, 8, 0, 3, 1.0f, 0.0f, true},     // dy @ w2^T, a few rows
      {true, false, 136, 72, 45, 0, 8, 0, 1.0f, 1.0f, true},     // dW += h^T dy, k = 45
      {true, true, 24, 40, 16, 16, 8, 1, 0.5f, 0.25f, true},     // both, alpha and beta
      {false, false, 129, 136, 8, 0, 0, 0, 1.0f, 0.0f, false},   // bf16 out, past a tile
      {true, false, 256, 384, 300, 0, 0, 0, 1.0f, 1.0f, false},  // bf16 out, beta 1
      {false, false, 1, 8, 2048, 0, 0, 0, 1.0f, 0.0f, true},     // one row, long k
  };
  std::vector<CudaBackend::Bf16Gemm> problems;
  std::vector<Vec> want;
  for (size_t t = 0; t < cases.size(); ++t) {
    const Case& c = cases[t];
    const int lda = (c.ta ? c.m : c.k) + c.pad_a, ldb = (c.tb ? c.k : c.n) + c.pad_b;
    const int ldc = c.n + c.pad_c;
    const Bf16Vec a = ToBf16(Random(int64_t{c.ta ? c.k : c.m} * lda, 10 + t));
    const Bf16Vec b = ToBf16(Random(int64_t{c.tb ? c.n : c.k} * ldb, 20 + t));
    Vec out = Random(int64_t{c.m} * ldc, 30 + t);
    if (!c.c_fp32) out = ToBf16(out).rounded;  // C as the kernel reads it
    void* dc = c.c_fp32 ? static_cast<void*>(Up(out)) : static_cast<void*>(Up(ToBf16(out).bits));
    CudaBackend::Bf16Gemm p{c.ta,       c.tb, c.m,    c.n, c.k, Up(a.bits), lda,
                            Up(b.bits), ldb,  c.beta, dc,  ldc, c.c_fp32,   c.alpha};
    ASSERT_TRUE(CudaBackend::KernelTakes(p)) << "case " << t;
    problems.push_back(p);
    cpu_.Gemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.rounded.data(), lda, b.rounded.data(), ldb,
              c.beta, out.data(), ldc);
    want.push_back(out);
  }
  // An empty product with beta 0 zeroes its C, as the fan-out does.
  Vec zeroed = Random(40 * 16, 41);
  problems.push_back(
      {false, false, 40, 16, 0, nullptr, 8, nullptr, 16, 0.0f, Up(zeroed), 16, true});
  ASSERT_TRUE(gpu_->KernelGemmBf16(problems, "grouped kernel test"));
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
  for (size_t t = 0; t < cases.size(); ++t) {
    SCOPED_TRACE(testing::Message() << "case " << t);
    Vec got;
    if (cases[t].c_fp32) {
      got = Down(static_cast<float*>(problems[t].c), want[t].size());
    } else {
      for (uint16_t bits : Down(static_cast<uint16_t*>(problems[t].c), want[t].size())) {
        got.push_back(Bf16ToFloat(bits));
      }
    }
    // fp32 outputs: the same exact products summed in another order. bf16: one rounding.
    ExpectClose("kernel", got, want[t], cases[t].c_fp32 ? 1e-5 : 1.0 / 128);
  }
  EXPECT_EQ(Down(static_cast<float*>(problems.back().c), zeroed.size()), Vec(zeroed.size(), 0.0f));
}

TEST_F(GroupedGemmTest, ProblemsItCannotLoadAreLeftToTheFanOut) {
  const Bf16Vec a = ToBf16(Random(64 * 64, 1)), b = ToBf16(Random(64 * 64, 2));
  Vec c(64 * 64, 7.0f);
  const uint16_t *da = Up(a.bits), *db = Up(b.bits);
  float* dc = Up(c);
  const CudaBackend::Bf16Gemm fine{false, false, 16, 16, 16, da, 64, db, 64, 0.0f, dc, 64, true};
  EXPECT_TRUE(CudaBackend::KernelTakes(fine));
  std::vector<CudaBackend::Bf16Gemm> odd_k = {fine}, odd_ld = {fine}, unaligned = {fine};
  odd_k[0].k = 12;          // A's rows of 12 elements: not whole 16-byte chunks
  odd_ld[0].ldb = 60;       // B's rows start off the 16-byte grid
  unaligned[0].a = da + 1;  // A itself off it
  for (const auto* set : {&odd_k, &odd_ld, &unaligned}) {
    EXPECT_FALSE(CudaBackend::KernelTakes((*set)[0]));
    EXPECT_FALSE(gpu_->KernelGemmBf16(*set, "not taken"));
  }
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(Down(dc, c.size()), c);  // nothing ran
}

// The expert FFN of the bf16 compute dtype through the grouped kernel gives the fan-out's
// outputs and gradients (each output is one product either way: same bits but for the
// order of the k sums, so within 1e-5).
TEST_F(GroupedGemmTest, ExpertFfnThroughTheKernelMatchesTheFanOut) {
  ASSERT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kBf16).ok());
  const int C = 64, F = 128, E = 4;
  const std::vector<int64_t> offsets = {0, 150, 150, 171, 300};  // an empty bucket too
  const int64_t A = offsets[E];
  const Vec x = Random(A * C, 1), dy = Random(A * C, 2, 0.01f);
  std::vector<compute::ExpertWeights> experts;
  std::vector<Vec> grads_init;
  for (int e = 0; e < E; ++e) {
    experts.push_back({Up(Random(C * F, 10 + e, 0.1f)), Up(Random(F, 20 + e, 0.1f)),
                       Up(Random(F * C, 30 + e, 0.1f)), Up(Random(C, 40 + e, 0.1f))});
  }
  struct Run {
    std::vector<Vec> out;
  };
  auto run = [&](CudaBackend::Bf16Products how) {
    gpu_->set_bf16_products(how);
    float *y = Up(Vec(A * C)), *hpre = Up(Vec(A * F)), *h = Up(Vec(A * F));
    float *dx = Up(Vec(A * C)), *dh = Up(Vec(A * F));
    std::vector<compute::ExpertGrads> grads;
    std::vector<float*> g;
    for (int e = 0; e < E; ++e) {
      grads.push_back(
          {Up(Vec(C * F, 0.5f)), Up(Vec(F, 0.5f)), Up(Vec(F * C, 0.5f)), Up(Vec(C, 0.5f))});
      g.insert(g.end(), {grads.back().w1, grads.back().b1, grads.back().w2, grads.back().b2});
    }
    gpu_->ExpertForward(y, hpre, h, Up(x), offsets.data(), experts, C, F);
    gpu_->ExpertBackward(dx, dh, grads, Up(dy), Up(x), hpre, h, offsets.data(), experts, C, F);
    EXPECT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    Run r;
    r.out = {Down(y, A * C), Down(hpre, A * F), Down(dx, A * C)};
    for (size_t i = 0; i < g.size(); ++i) {
      r.out.push_back(Down(g[i], i % 4 == 0 || i % 4 == 2 ? C * F : i % 4 == 1 ? F : C));
    }
    return r;
  };
  const Run fan = run(CudaBackend::Bf16Products::kFanOut);
  const Run kernel = run(CudaBackend::Bf16Products::kKernel);
  ASSERT_EQ(fan.out.size(), kernel.out.size());
  for (size_t i = 0; i < fan.out.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "output " << i);
    ExpectClose("kernel vs fan-out", kernel.out[i], fan.out[i]);
  }
}

}  // namespace
}  // namespace pith::cuda
