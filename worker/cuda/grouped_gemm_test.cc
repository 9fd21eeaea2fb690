// CudaBackend's own grouped bf16 kernel (cuda_grouped.cu) against the CPU backend's fp32
// product of the same bf16-rounded inputs: every transpose, sizes that are not multiples
// of the tile (and a k that ends mid-step), padded leading dimensions, alpha and beta,
// fp32 and bf16 outputs, empty problems, C never read with beta 0; the identity, whose
// failures say where each element went; the problems it does not take; and the expert
// FFN in the bf16 compute dtype, which must give the fan-out's results through the kernel
// and fall back to the fan-out where the kernel cannot load a phase. Skipped without a
// CUDA device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <utility>
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

class GroupedGemmTest : public testing_support::CudaTest {
 protected:
  // Every tile shape of both kernels; those this device or build does not run (the wgmma
  // ones off sm_90, or without the build's sm_90a code) are left out, with a note.
  std::vector<CudaBackend::KernelTile> Tiles() {
    std::vector<CudaBackend::KernelTile> runs;
    for (CudaBackend::KernelTile tile :
         {CudaBackend::KernelTile::k128x128, CudaBackend::KernelTile::k128x256,
          CudaBackend::KernelTile::k256x128, CudaBackend::KernelTile::kWgmma128x128,
          CudaBackend::KernelTile::kWgmma128x256}) {
      if (gpu_->KernelTileRuns(tile)) {
        runs.push_back(tile);
      } else {
        std::printf("tile shape %d does not run here: not checked\n", static_cast<int>(tile));
      }
    }
    return runs;
  }
  // Every case of EveryTransposeShapeAndOutputMatchesTheCpu in one launch, checked.
  void CheckCases();
  // Products of n x n with the identity, each transpose; `tile` names the shape in
  // failures.
  void CheckIdentity(int tile, int n);
};

struct Case {
  bool ta, tb;
  int m, n, k;
  int pad_a, pad_b, pad_c;  // added to the leading dimensions (multiples of 8 for a, b)
  float alpha, beta;
  bool c_fp32;
};

TEST_F(GroupedGemmTest, EveryTransposeShapeAndOutputMatchesTheCpu) {
  for (CudaBackend::KernelTile tile : Tiles()) {
    SCOPED_TRACE(testing::Message() << "tile shape " << static_cast<int>(tile));
    gpu_->set_kernel_tile(tile);
    CheckCases();
  }
}

void GroupedGemmTest::CheckCases() {
  const std::vector<Case> cases = {
      {false, false, 200, 136, 64, 0, 0, 0, 1.0f, 0.0f, true},   // forward: x @ w1
      {false, true, 37, 264, 96, 8, 0, 3, 1.0f, 0.0f, true},     // dy @ w2^T, a few rows
      {true, false, 136, 72, 45, 0, 8, 0, 1.0f, 1.0f, true},     // dW += h^T dy, k = 45
      {true, true, 24, 40, 16, 16, 8, 1, 0.5f, 0.25f, true},     // both, alpha and beta
      {false, false, 129, 136, 8, 0, 0, 0, 1.0f, 0.0f, false},   // bf16 out, past a tile
      {true, false, 256, 384, 300, 0, 0, 0, 1.0f, 1.0f, false},  // bf16 out, beta 1
      {false, false, 1, 8, 2048, 0, 0, 0, 1.0f, 0.0f, true},     // one row, long k
      {false, false, 72, 64, 40, 0, 0, 0, 1.0f, 0.0f, true},     // k ends mid-step
      {true, true, 32, 48, 40, 8, 0, 0, 1.0f, 0.0f, false},      // the same, transposed
      {false, true, 50, 37, 64, 0, 0, 1, 1.0f, 0.0f, true},      // odd n, even ldc: pairs
      {true, true, 40, 33, 24, 8, 0, 0, 1.0f, 0.5f, false},      // odd n and ldc, bf16 out
      // Past two tiles each way with k over every kernel's pipeline stages (the wgmma
      // kernel's 5 of 64 at 128 x 128): each stage refilled while the others are read.
      {false, false, 256, 264, 520, 0, 0, 0, 1.0f, 0.0f, true},
      {true, false, 264, 256, 520, 0, 0, 2, 1.0f, 0.5f, true},
      {false, true, 256, 256, 520, 0, 0, 0, 1.0f, 0.0f, false},
      {true, true, 264, 264, 520, 8, 8, 0, 1.0f, 1.0f, true},
  };
  std::vector<CudaBackend::Bf16Gemm> problems;
  std::vector<Vec> want;
  std::vector<size_t> slot;  // cases[t]'s index in problems
  for (size_t t = 0; t < cases.size(); ++t) {
    const Case& c = cases[t];
    const int lda = (c.ta ? c.m : c.k) + c.pad_a, ldb = (c.tb ? c.k : c.n) + c.pad_b;
    const int ldc = c.n + c.pad_c;
    const Bf16Vec a = ToBf16(Random(int64_t{c.ta ? c.k : c.m} * lda, 10 + t));
    const Bf16Vec b = ToBf16(Random(int64_t{c.tb ? c.n : c.k} * ldb, 20 + t));
    Vec out = Random(int64_t{c.m} * ldc, 30 + t);
    if (!c.c_fp32) out = ToBf16(out).rounded;  // C as the kernel reads it
    // With beta 0 the kernel must not read C: it starts as NaN there.
    const Vec start = c.beta == 0.0f ? Vec(out.size(), std::nanf("")) : out;
    void* dc =
        c.c_fp32 ? static_cast<void*>(Up(start)) : static_cast<void*>(Up(ToBf16(start).bits));
    CudaBackend::Bf16Gemm p{c.ta,       c.tb, c.m,    c.n, c.k, Up(a.bits), lda,
                            Up(b.bits), ldb,  c.beta, dc,  ldc, c.c_fp32,   c.alpha};
    ASSERT_TRUE(CudaBackend::KernelTakes(p)) << "case " << t;
    slot.push_back(problems.size());
    problems.push_back(p);
    cpu_.Gemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.rounded.data(), lda, b.rounded.data(), ldb,
              c.beta, out.data(), ldc);
    want.push_back(out);
  }
  // An empty product with beta 0, in the middle of the list, zeroes its C, as the fan-out
  // does (the padding columns of each C are compared too: nothing may land there).
  Vec zeroed = Random(40 * 16, 41);
  float* dzeroed = Up(zeroed);
  problems.insert(problems.begin() + 3,
                  {false, false, 40, 16, 0, nullptr, 8, nullptr, 16, 0.0f, dzeroed, 16, true});
  for (size_t t = 3; t < slot.size(); ++t) ++slot[t];
  ASSERT_TRUE(gpu_->KernelGemmBf16(problems, "grouped kernel test"));
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
  for (size_t t = 0; t < cases.size(); ++t) {
    SCOPED_TRACE(testing::Message() << "case " << t);
    const CudaBackend::Bf16Gemm& p = problems[slot[t]];
    Vec got;
    if (cases[t].c_fp32) {
      got = Down(static_cast<float*>(p.c), want[t].size());
    } else {
      for (uint16_t bits : Down(static_cast<uint16_t*>(p.c), want[t].size())) {
        got.push_back(Bf16ToFloat(bits));
      }
    }
    // Padding columns: left as they were (NaN with beta 0; else the C both sides started
    // from, which the CPU leaves there).
    for (int r = 0; r < cases[t].m; ++r) {
      for (int col = cases[t].n; col < p.ldc; ++col) {
        const size_t at = static_cast<size_t>(r) * p.ldc + col;
        if (cases[t].beta == 0.0f) {
          EXPECT_TRUE(std::isnan(got[at])) << "padding [" << r << "][" << col << "] written";
        } else {
          EXPECT_EQ(got[at], want[t][at]) << "padding [" << r << "][" << col << "] written";
        }
        got[at] = want[t][at];
      }
    }
    // fp32 outputs: the same exact products summed in another order, by tensor cores that
    // truncate partial sums (k = 2048 takes 128 steps); a misplaced element is off by O(1).
    // bf16: one rounding.
    ExpectClose("kernel", got, want[t], cases[t].c_fp32 ? 1e-4 : 1.0 / 128);
  }
  EXPECT_EQ(Down(dzeroed, zeroed.size()), Vec(zeroed.size(), 0.0f));
}

// A product with the identity gives the other operand back exactly, for every transpose:
// where it does not, the values (small integers, each naming its source element) show
// which element went where, the first thing to read if the kernel's fragments are wrong.
// 48: within one tile, not a multiple of the 16 x 64 warp blocks; 160: past 128 rows and
// columns (the wgmma kernel's second warpgroup and second 128-column half, a second tile
// of the others) and three k steps of 64.
TEST_F(GroupedGemmTest, TheIdentityGivesTheOtherOperandBackForEveryTranspose) {
  for (CudaBackend::KernelTile tile : Tiles()) {
    gpu_->set_kernel_tile(tile);
    for (int n : {48, 160}) CheckIdentity(static_cast<int>(tile), n);
  }
}

void GroupedGemmTest::CheckIdentity(int tile, int kN) {
  Vec operand(kN * kN), identity(kN * kN, 0.0f);
  for (int i = 0; i < kN * kN; ++i) operand[i] = static_cast<float>(i % 251 - 125);  // exact
  for (int i = 0; i < kN; ++i) identity[i * kN + i] = 1.0f;
  const uint16_t* x = Up(ToBf16(operand).bits);
  const uint16_t* eye = Up(ToBf16(identity).bits);
  for (int variant = 0; variant < 8; ++variant) {
    const bool ta = variant & 1, tb = variant & 2, identity_left = variant & 4;
    // op(stored X) is X or X^T; the wanted C is that, row-major.
    const bool x_trans = identity_left ? tb : ta;
    Vec want(kN * kN);
    for (int r = 0; r < kN; ++r) {
      for (int c = 0; c < kN; ++c) want[r * kN + c] = operand[x_trans ? c * kN + r : r * kN + c];
    }
    float* out = Up(Vec(kN * kN, -1.0f));
    const CudaBackend::Bf16Gemm p{
        ta, tb,   kN,  kN, kN,  identity_left ? eye : x, kN, identity_left ? x : eye,
        kN, 0.0f, out, kN, true};
    ASSERT_TRUE(gpu_->KernelGemmBf16({p}, "identity test"));
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    const Vec got = Down(out, want.size());
    int shown = 0;
    for (int i = 0; i < kN * kN && shown < 8; ++i) {
      if (got[i] == want[i]) continue;
      ADD_FAILURE() << "tile shape " << tile << ", n " << kN << ", trans_a " << ta << " trans_b "
                    << tb << " identity " << (identity_left ? "left" : "right") << ": C[" << i / kN
                    << "][" << i % kN << "] = " << got[i] << ", want " << want[i];
      ++shown;
    }
  }
}

TEST_F(GroupedGemmTest, ProblemsItCannotLoadAreRefusedUntouched) {
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

// The epilogues against the CPU backend's own passes on the CPU's product: bias then gelu
// (fp32 and bf16 outputs), and gelu's derivative with a bf16 copy, each output starting as
// NaN; with an even leading dimension (pairs of columns stored together) and an odd one
// (one at a time). The cuBLAS paths refuse an epilogue, naming the op.
TEST_F(GroupedGemmTest, EpiloguesMatchTheCpusPasses) {
  const int m = 150, n = 136, k = 64;
  const Bf16Vec a = ToBf16(Random(m * k, 1)), b = ToBf16(Random(k * n, 2, 0.2f));
  const Vec bias = Random(n, 3);
  Vec product(m * n);
  cpu_.Gemm(false, false, m, n, k, 1.0f, a.rounded.data(), k, b.rounded.data(), n, 0.0f,
            product.data(), n);
  const uint16_t *da = Up(a.bits), *db = Up(b.bits);
  for (int ldc : {n, n + 1}) {
    Vec aux = Random(m * ldc, 4), pre(m * ldc, 0.0f), gelu(m * ldc, 0.0f), grad(m * ldc, 0.0f);
    for (int r = 0; r < m; ++r) {
      for (int c = 0; c < n; ++c) pre[r * ldc + c] = product[r * n + c] + bias[c];
    }
    cpu_.Gelu(gelu.data(), pre.data(), m * ldc);
    Vec product_ld(m * ldc, 0.0f);
    for (int r = 0; r < m; ++r) {
      for (int c = 0; c < n; ++c) product_ld[r * ldc + c] = product[r * n + c];
    }
    cpu_.GeluBackward(grad.data(), aux.data(), product_ld.data(), m * ldc);
    for (CudaBackend::KernelTile tile : Tiles()) {
      SCOPED_TRACE(testing::Message()
                   << "ldc " << ldc << ", tile shape " << static_cast<int>(tile));
      // Tensor cores sum a k step's bf16 products with truncation: fp32 outputs within
      // 1e-4 (as the plain products), far under what a misplaced element would be.
      constexpr double kTensorCore = 1e-4;
      gpu_->set_kernel_tile(tile);
      const Vec nan(m * ldc, std::nanf(""));
      const std::vector<uint16_t> nan_bits(m * ldc, 0x7fc0);
      float *c1 = Up(nan), *g1 = Up(nan), *c2 = Up(nan);
      uint16_t *gb1 = Up(nan_bits), *cb2 = Up(nan_bits);
      CudaBackend::Bf16Gemm forward{false, false, m, n, k, da, k, db, n, 0.0f, c1, ldc, true};
      forward.epilogue.bias = Up(bias);
      forward.epilogue.gelu_out = g1;
      forward.epilogue.gelu_bf16 = gb1;
      CudaBackend::Bf16Gemm backward = forward;
      backward.c = c2;
      backward.epilogue = {};
      backward.epilogue.gelu_grad_of = Up(aux);
      backward.epilogue.c_bf16 = cb2;
      ASSERT_TRUE(gpu_->KernelGemmBf16({forward, backward}, "epilogue test"));
      ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
      // The rows' padding columns are not outputs: compared as the CPU's zeros.
      auto got = [&](const Vec& values) {
        Vec out = values;
        for (int r = 0; r < m; ++r) {
          for (int c = n; c < ldc; ++c) out[r * ldc + c] = 0.0f;
        }
        return out;
      };
      auto widen = [&](const uint16_t* dev) {
        Vec out;
        for (uint16_t bits : Down(dev, m * ldc)) out.push_back(Bf16ToFloat(bits));
        return got(out);
      };
      ExpectClose("x @ w + bias", got(Down(c1, m * ldc)), pre, kTensorCore);
      ExpectClose("gelu", got(Down(g1, m * ldc)), gelu, kTensorCore);
      ExpectClose("gelu in bf16", widen(gb1), gelu, 1.0 / 128);
      ExpectClose("gelu'", got(Down(c2, m * ldc)), grad, kTensorCore);
      ExpectClose("gelu' in bf16", widen(cb2), grad, 1.0 / 128);
    }
  }
  // k = 0: no k step, the epilogue on beta C alone (here C + b1).
  for (CudaBackend::KernelTile tile : Tiles()) {
    SCOPED_TRACE(testing::Message() << "k = 0, tile shape " << static_cast<int>(tile));
    gpu_->set_kernel_tile(tile);
    const Vec start = Random(m * n, 5);
    Vec want = start;
    for (int r = 0; r < m; ++r) {
      for (int c = 0; c < n; ++c) want[r * n + c] += bias[c];
    }
    float* dc = Up(start);
    CudaBackend::Bf16Gemm empty{false, false, m, n, 0, da, 8, db, n, 1.0f, dc, n, true};
    empty.epilogue.bias = Up(bias);
    ASSERT_TRUE(gpu_->KernelGemmBf16({empty}, "k = 0 with an epilogue"));
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    ExpectClose("C + bias", Down(dc, m * n), want);
  }
  const CudaBackend::Bf16Gemm with_epilogue{false, false,   8, 8,    8,    nullptr,   8, nullptr, 8,
                                            0.0f,  nullptr, 8, true, 1.0f, {Up(bias)}};
  EXPECT_FALSE(CudaBackend::KernelTakes({false, false, 8, 8, 8, da, 8, db, 8, 0.0f,
                                         Up(std::vector<uint16_t>(64)), 8, false, 1.0f,
                                         with_epilogue.epilogue}))
      << "an epilogue needs fp32 C";
  gpu_->FanOutGemmBf16({with_epilogue, with_epilogue}, "fan-out with an epilogue");
  EXPECT_NE(gpu_->Synchronize().message().find("fan-out with an epilogue"),
            absl::string_view::npos);
}

// cuBLAS's batched calls over row chunks (BatchedGemmBf16, batch_plan.h) against the CPU:
// an expert phase's products (rows past whole chunks, buckets under a chunk, one under 16
// rows, an empty one) into fp32 and into bf16, and weight-gradient-like products that
// accumulate (beta 1) with rows past the last chunk. With beta 0, C starts as NaN.
TEST_F(GroupedGemmTest, BatchedCallsMatchTheCpu) {
  struct Set {
    bool ta, tb, c_fp32;
    float beta;
    int n, k, lda;
  };
  const std::vector<int> rows = {300, 128, 77, 5, 1000, 129, 20, 0, 64};
  const uint64_t before = gpu_->batched_calls();
  for (const Set& set :
       {Set{false, false, true, 0.0f, 72, 48, 48}, Set{false, true, false, 0.0f, 40, 56, 56},
        Set{true, false, true, 1.0f, 24, 32, 1000}, Set{true, false, true, 0.0f, 24, 32, 1000}}) {
    SCOPED_TRACE(testing::Message()
                 << "trans_a " << set.ta << " trans_b " << set.tb << " fp32 C " << set.c_fp32);
    const int ldb = set.tb ? set.k : set.n;
    const Bf16Vec b = ToBf16(Random(int64_t{set.k} * set.n, 2));  // shared, as an expert's
    std::vector<CudaBackend::Bf16Gemm> problems;
    std::vector<Vec> want;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int m = rows[i];
      const Bf16Vec a = ToBf16(Random(int64_t{set.ta ? set.k : m} * set.lda, 10 + i));
      Vec out = Random(int64_t{m} * set.n, 30 + i);
      if (!set.c_fp32) out = ToBf16(out).rounded;
      const Vec start = set.beta == 0.0f ? Vec(out.size(), std::nanf("")) : out;
      void* dc =
          set.c_fp32 ? static_cast<void*>(Up(start)) : static_cast<void*>(Up(ToBf16(start).bits));
      problems.push_back({set.ta, set.tb, m, set.n, set.k, Up(a.bits), set.lda, Up(b.bits), ldb,
                          set.beta, dc, set.n, set.c_fp32});
      cpu_.Gemm(set.ta, set.tb, m, set.n, set.k, 1.0f, a.rounded.data(), set.lda, b.rounded.data(),
                ldb, set.beta, out.data(), set.n);
      want.push_back(out);
    }
    gpu_->BatchedGemmBf16(problems, "batched test");
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    for (size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "rows " << rows[i]);
      const CudaBackend::Bf16Gemm& p = problems[i];
      const size_t n = want[i].size();
      if (set.c_fp32) {
        ExpectClose("batched", Down(static_cast<float*>(p.c), n), want[i], 1e-4);
      } else {
        Vec got;
        for (uint16_t bits : Down(static_cast<uint16_t*>(p.c), n)) got.push_back(Bf16ToFloat(bits));
        ExpectClose("batched bf16", got, want[i], 1.0 / 128);
      }
    }
  }
  // Per set, a call of whole chunks for the 128-row group (300, 128, 1000, 129) and the
  // 64-row one (77, 64); with beta 0 a call of tails for each as well (4 + 4 + 2). With A
  // transposed a tail moves A by columns: only 1000's (column 872, 1744 bytes) starts
  // 16-byte aligned, so one tail call, the other remainders alone (+ 3).
  // The figures above hold either way (a refused call's products run one by one); this
  // says apart a cuBLAS that takes no batched bf16 call with fp32 C, a fact of the
  // library, from a wrong count of calls.
  const uint64_t calls = gpu_->batched_calls() - before;
  EXPECT_NE(calls, 0u) << "this cuBLAS refused every batched call (bf16 A and B, fp32 or bf16 "
                          "C): the products ran one call each, right but not batched";
  if (calls != 0) {
    EXPECT_EQ(calls, 13u) << "batched calls other than planned";
  }
}

class GroupedFfnTest : public GroupedGemmTest {
 protected:
  // The expert FFN forward and backward in the bf16 compute dtype with hidden size F, its
  // products as `how` says: y, hpre, dx, then every expert's gradients.
  std::vector<Vec> Ffn(int F, CudaBackend::Bf16Products how) {
    EXPECT_TRUE(gpu_->SetComputeDtype(ComputeDtype::kBf16).ok());
    gpu_->set_bf16_products(how);
    const int C = 64, E = 4;
    const std::vector<int64_t> offsets = {0, 150, 150, 171, 300};  // an empty bucket too
    const int64_t A = offsets[E];
    std::vector<compute::ExpertWeights> experts;
    std::vector<compute::ExpertGrads> grads;
    float *y = Up(Vec(A * C)), *hpre = Up(Vec(A * F)), *h = Up(Vec(A * F));
    float *dx = Up(Vec(A * C)), *dh = Up(Vec(A * F));
    std::vector<std::pair<float*, int64_t>> outputs = {{y, A * C}, {hpre, A * F}, {dx, A * C}};
    for (int e = 0; e < E; ++e) {
      experts.push_back({Up(Random(C * F, 10 + e, 0.1f)), Up(Random(F, 20 + e, 0.1f)),
                         Up(Random(F * C, 30 + e, 0.1f)), Up(Random(C, 40 + e, 0.1f))});
      grads.push_back(
          {Up(Vec(C * F, 0.5f)), Up(Vec(F, 0.5f)), Up(Vec(F * C, 0.5f)), Up(Vec(C, 0.5f))});
      const compute::ExpertGrads& g = grads.back();
      outputs.insert(outputs.end(), {{g.w1, C * F}, {g.b1, F}, {g.w2, F * C}, {g.b2, C}});
    }
    const float* x = Up(Random(A * C, 1));
    gpu_->ExpertForward(y, hpre, h, x, offsets.data(), experts, C, F);
    gpu_->ExpertBackward(dx, dh, grads, Up(Random(A * C, 2, 0.01f)), x, hpre, h, offsets.data(),
                         experts, C, F);
    EXPECT_TRUE(gpu_->Synchronize().ok()) << gpu_->status();
    std::vector<Vec> out;
    for (const auto& [dev, n] : outputs) out.push_back(Down(dev, n));
    return out;
  }
  // Within 1e-3: the products' sums differ in order, and an fp32 ulp apart can round an
  // activation to the next bf16 value (2^-8 relative) before the next phase; a wrong
  // epilogue is off by far more.
  void ExpectSame(const std::vector<Vec>& kernel, const std::vector<Vec>& fan) {
    ASSERT_EQ(kernel.size(), fan.size());
    for (size_t i = 0; i < fan.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "output " << i);
      ExpectClose("kernel vs fan-out", kernel[i], fan[i], 1e-3);
    }
  }
};

// The expert FFN of the bf16 compute dtype through the grouped kernel (one launch per
// phase: 4; bias, gelu and gelu's derivative in its epilogues, the activations between
// phases handed on in bf16) gives the fan-out's outputs and gradients (the products and
// separate passes): each output is one product either way, summed in another order, then
// the same element-wise operations (see ExpectSame).
TEST_F(GroupedFfnTest, ThroughTheKernelItMatchesTheFanOut) {
  const std::vector<Vec> fan = Ffn(128, CudaBackend::Bf16Products::kFanOut);
  const uint64_t before = gpu_->kernel_launches();
  const uint64_t epilogues = gpu_->epilogue_launches();
  const std::vector<Vec> kernel = Ffn(128, CudaBackend::Bf16Products::kKernel);
  EXPECT_EQ(gpu_->kernel_launches() - before, 4u);
  EXPECT_EQ(gpu_->epilogue_launches() - epilogues, 3u);  // x @ w1, h @ w2, dH
  ExpectSame(kernel, fan);
}

// The same with the products as cuBLAS batched calls of row chunks: buckets of 150 and
// 129 rows batch, 21 rows run alone.
TEST_F(GroupedFfnTest, ThroughBatchedCallsItMatchesTheFanOut) {
  const std::vector<Vec> fan = Ffn(128, CudaBackend::Bf16Products::kFanOut);
  const uint64_t before = gpu_->batched_calls();
  const std::vector<Vec> batched = Ffn(128, CudaBackend::Bf16Products::kBatched);
  EXPECT_GT(gpu_->batched_calls(), before);
  ExpectSame(batched, fan);
}

// The same through the warpgroup-MMA kernel, where this device runs it.
TEST_F(GroupedFfnTest, ThroughTheWgmmaKernelItMatchesTheFanOut) {
  if (!gpu_->KernelTileRuns(CudaBackend::KernelTile::kWgmma128x128)) {
    GTEST_SKIP() << "the wgmma kernel needs an sm_90 device and the build's sm_90a code";
  }
  const std::vector<Vec> fan = Ffn(128, CudaBackend::Bf16Products::kFanOut);
  for (CudaBackend::KernelTile tile :
       {CudaBackend::KernelTile::kWgmma128x128, CudaBackend::KernelTile::kWgmma128x256}) {
    SCOPED_TRACE(testing::Message() << "tile shape " << static_cast<int>(tile));
    gpu_->set_kernel_tile(tile);
    const uint64_t before = gpu_->kernel_launches();
    const std::vector<Vec> kernel = Ffn(128, CudaBackend::Bf16Products::kKernel);
    EXPECT_EQ(gpu_->kernel_launches() - before, 4u);
    ExpectSame(kernel, fan);
  }
}

// A build with sm_90a code runs the wgmma kernel on every sm_90 device: were the probe or
// the build to lose it, every test above would skip its wgmma tiles and pass.
TEST_F(GroupedGemmTest, AnSm90aBuildRunsTheWgmmaKernelOnSm90) {
#ifndef PITH_BUILT_SM90A
  GTEST_SKIP() << "this build has no sm_90a code";
#else
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  if (major != 9 || minor != 0) GTEST_SKIP() << "sm_" << major << minor << ", not sm_90";
  EXPECT_TRUE(gpu_->KernelTileRuns(CudaBackend::KernelTile::kWgmma128x128));
  EXPECT_TRUE(gpu_->KernelTileRuns(CudaBackend::KernelTile::kWgmma128x256));
#endif
}

// A hidden size of 100 leaves rows of h that are not whole 16-byte chunks: every phase
// goes to the fan-out, with the same results.
TEST_F(GroupedFfnTest, ShapesTheKernelCannotLoadGoToTheFanOut) {
  const std::vector<Vec> fan = Ffn(100, CudaBackend::Bf16Products::kFanOut);
  const uint64_t before = gpu_->kernel_launches();
  const std::vector<Vec> kernel = Ffn(100, CudaBackend::Bf16Products::kKernel);
  EXPECT_EQ(gpu_->kernel_launches(), before);
  ExpectSame(kernel, fan);
}

}  // namespace
}  // namespace pith::cuda
