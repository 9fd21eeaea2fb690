// PlanBatches on the host: running its calls and single products, in order, with a plain
// reference product, writes exactly what running the products themselves writes (row
// chunks do not change any element's sum), no two entries of one call write the same
// bytes, and products go where the plan's rules send them. Needs no GPU.
#include "worker/cuda/batch_plan.h"

#include <cstring>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "gtest/gtest.h"

namespace pith::cuda {
namespace {

float Bf16At(uintptr_t base, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<const void*>(base + 2 * i), 2);
  return Bf16ToFloat(bits);
}

// C = alpha op(A) op(B) + beta C, summing over k in order.
void Reference(const PlanProduct& p) {
  for (int i = 0; i < p.m; ++i) {
    for (int j = 0; j < p.n; ++j) {
      float acc = 0;
      for (int l = 0; l < p.k; ++l) {
        const float a = Bf16At(p.a, p.trans_a ? int64_t{l} * p.lda + i : int64_t{i} * p.lda + l);
        const float b = Bf16At(p.b, p.trans_b ? int64_t{j} * p.ldb + l : int64_t{l} * p.ldb + j);
        acc += a * b;
      }
      const int64_t at = int64_t{i} * p.ldc + j;
      if (p.c_fp32) {
        float* c = reinterpret_cast<float*>(p.c) + at;
        *c = p.alpha * acc + p.beta * *c;
      } else {
        uint16_t* c = reinterpret_cast<uint16_t*>(p.c) + at;
        *c = RoundToBf16(p.alpha * acc + p.beta * Bf16ToFloat(*c));
      }
    }
  }
}

// Bytes of C a product writes: [first, last).
std::pair<uintptr_t, uintptr_t> OutputBytes(const PlanProduct& p) {
  const uintptr_t elem = p.c_fp32 ? 4 : 2;
  return {p.c, p.c + (uintptr_t(p.m - 1) * p.ldc + p.n) * elem};
}

// Buffers for a set of products: bf16 inputs and fp32 or bf16 outputs, random.
class Products {
 public:
  explicit Products(uint32_t seed) : rng_(seed) {}
  // Adds a product over fresh buffers, A and B shared with the last call's where asked;
  // `pad` widens A's and C's rows (an odd pad leaves rows past the first off alignment).
  PlanProduct& Add(bool ta, bool tb, int m, int n, int k, float beta, bool c_fp32,
                   bool share_b = false, int pad = 0) {
    PlanProduct p;
    p.trans_a = ta;
    p.trans_b = tb;
    p.m = m;
    p.n = n;
    p.k = k;
    p.lda = (ta ? 512 : k) + pad;  // m is at most 512: A's stored rows span any m
    p.ldb = tb ? k : n;
    p.ldc = n + pad;
    p.beta = beta;
    p.c_fp32 = c_fp32;
    p.a = Bf16Buffer(int64_t{p.lda} * (ta ? k : m));
    p.b = share_b && !list_.empty() ? list_.back().b : Bf16Buffer(int64_t{k} * n);
    const int64_t c_elems = int64_t{m} * p.ldc;
    if (c_fp32) {
      floats_.emplace_back(c_elems);
      for (float& v : floats_.back()) v = dist_(rng_);
      p.c = reinterpret_cast<uintptr_t>(floats_.back().data());
    } else {
      p.c = Bf16Buffer(c_elems);
    }
    list_.push_back(p);
    return list_.back();
  }
  const std::vector<PlanProduct>& list() const { return list_; }
  // Every output's bytes, for comparing two runs.
  std::vector<std::vector<uint8_t>> Outputs() const {
    std::vector<std::vector<uint8_t>> out;
    for (const PlanProduct& p : list_) {
      const auto [first, last] = OutputBytes(p);
      out.emplace_back(reinterpret_cast<const uint8_t*>(first),
                       reinterpret_cast<const uint8_t*>(last));
    }
    return out;
  }
  void Restore(const std::vector<std::vector<uint8_t>>& saved) const {
    for (size_t i = 0; i < list_.size(); ++i) {
      std::memcpy(reinterpret_cast<void*>(list_[i].c), saved[i].data(), saved[i].size());
    }
  }

 private:
  uintptr_t Bf16Buffer(int64_t n) {
    bf16_.emplace_back(n);
    for (uint16_t& v : bf16_.back()) v = RoundToBf16(dist_(rng_));
    return reinterpret_cast<uintptr_t>(bf16_.back().data());
  }
  std::mt19937 rng_;
  std::uniform_real_distribution<float> dist_{-1.0f, 1.0f};
  std::vector<std::vector<uint16_t>> bf16_;
  std::vector<std::vector<float>> floats_;
  std::vector<PlanProduct> list_;
};

// Runs the plan with Reference and checks what the device's order allows: the entries of
// one call run at once, and the singles beside every call, so none of those may write
// bytes another writes; calls run one after the other, so an entry of a later call may
// write rows an earlier one did only where both overwrite (beta 0: a tail).
void RunPlan(const BatchPlan& plan) {
  struct Written {
    std::pair<uintptr_t, uintptr_t> bytes;
    int call;  // -1: a single
    float beta;
  };
  std::vector<Written> written;
  auto check = [&](const PlanProduct& p, int call) {
    const auto bytes = OutputBytes(p);
    for (const Written& other : written) {
      if (bytes.second <= other.bytes.first || other.bytes.second <= bytes.first) continue;
      ASSERT_TRUE(call >= 0 && other.call >= 0 && call != other.call && p.beta == 0.0f &&
                  other.beta == 0.0f)
          << "call " << call << " and call " << other.call << " (-1: a single) write the "
          << "same bytes where they may run at once or accumulate";
    }
    written.push_back({bytes, call, p.beta});
  };
  for (size_t c = 0; c < plan.calls.size(); ++c) {
    const BatchedCall& call = plan.calls[c];
    for (int i = 0; i < call.count(); ++i) {
      PlanProduct p = call.shape;
      p.a = call.a[i];
      p.b = call.b[i];
      p.c = call.c[i];
      check(p, static_cast<int>(c));
      Reference(p);
    }
  }
  for (const PlanProduct& p : plan.single) {
    check(p, -1);
    Reference(p);
  }
}

void ExpectPlanMatches(const Products& products, const BatchPlan& plan) {
  const auto before = products.Outputs();
  for (const PlanProduct& p : products.list()) Reference(p);
  const auto want = products.Outputs();
  products.Restore(before);
  RunPlan(plan);
  const auto got = products.Outputs();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << "product " << i << " (m " << products.list()[i].m << ")";
  }
}

// An expert FFN phase's shapes: one product per expert with its own rows, sharing n and k.
TEST(BatchPlanTest, ExpertPhasesRunAsChunksAndTails) {
  Products products(1);
  const int rows[] = {300, 128, 256, 77, 20, 5, 129, 1000};
  for (int m : rows) products.Add(false, false, m, 24, 16, 0.0f, true);
  for (int m : rows) products.Add(false, true, m, 16, 24, 0.0f, false);  // bf16 C, B^T
  const BatchPlan plan = PlanBatches(products.list());
  ExpectPlanMatches(products, plan);
  // Per shape: 128-row chunks of 300, 128, 256, 129 and 1000, and their tails; 77 takes
  // 64-row chunks, 20 takes 16-row ones, with 5 left alone (under 16 rows) and each of the
  // 64- and 16-row groups holding one product, so those run alone too.
  ASSERT_EQ(plan.calls.size(), 4u);
  EXPECT_EQ(plan.calls[0].shape.m, 128);
  EXPECT_EQ(plan.calls[0].count(), 2 + 1 + 2 + 1 + 7);
  EXPECT_EQ(plan.calls[2].count(), 3);  // tails of 300, 129 and 1000
  EXPECT_EQ(plan.single.size(), 6u);    // 77, 20 and 5, twice
}

// Products that accumulate (beta 1) take no tail: the rows past the last chunk run alone.
// Transposed A moves by columns.
TEST(BatchPlanTest, AccumulatingProductsRunTheirRemainderAlone) {
  Products products(2);
  for (int m : {200, 130, 256}) products.Add(true, false, m, 8, 12, 1.0f, true);
  const BatchPlan plan = PlanBatches(products.list());
  ExpectPlanMatches(products, plan);
  ASSERT_EQ(plan.calls.size(), 1u);
  EXPECT_EQ(plan.calls[0].count(), 1 + 1 + 2);
  ASSERT_EQ(plan.single.size(), 2u);
  EXPECT_EQ(plan.single[0].m, 72);
  EXPECT_EQ(plan.single[1].m, 2);
}

// Shapes no other product shares run alone; products that share one batch together, in
// the order they came, the same B allowed.
TEST(BatchPlanTest, ShapesOfTheirOwnRunAloneAndSharedInputsBatch) {
  Products products(3);
  products.Add(false, false, 256, 8, 12, 0.0f, true);
  products.Add(false, false, 256, 8, 12, 0.0f, true, /*share_b=*/true);
  products.Add(false, false, 256, 8, 13, 0.0f, true);  // another k: alone
  products.Add(false, false, 256, 8, 12, 0.5f, true);  // another beta: alone
  const BatchPlan plan = PlanBatches(products.list());
  ExpectPlanMatches(products, plan);
  ASSERT_EQ(plan.calls.size(), 1u);
  EXPECT_EQ(plan.calls[0].count(), 4);
  EXPECT_EQ(plan.calls[0].b[0], plan.calls[0].b[2]);
  EXPECT_EQ(plan.single.size(), 2u);
  EXPECT_TRUE(PlanBatches({}).calls.empty());
}

// Entries of a batched call start 16-byte aligned (cuBLAS cannot check pointers on the
// device): a product whose base is not runs alone, and one whose tail would start off
// alignment (an odd leading dimension) runs its remaining rows alone instead.
TEST(BatchPlanTest, EntriesStartAligned) {
  Products products(5);
  products.Add(false, false, 300, 8, 16, 0.0f, true, false, /*pad=*/1);
  products.Add(false, false, 201, 8, 16, 0.0f, true, false, /*pad=*/1);
  PlanProduct& off = products.Add(false, false, 256, 8, 16, 0.0f, true, false, /*pad=*/1);
  off.a += 2;  // one bf16 in: the product reads its own buffer one element on
  off.m = 255;
  const BatchPlan plan = PlanBatches(products.list());
  ExpectPlanMatches(products, plan);
  ASSERT_EQ(plan.calls.size(), 1u);  // whole chunks only: no tail starts aligned
  EXPECT_EQ(plan.calls[0].count(), 2 + 1);
  for (const BatchedCall& call : plan.calls) {
    for (int i = 0; i < call.count(); ++i) {
      EXPECT_EQ(call.a[i] % 16, 0u);
      EXPECT_EQ(call.b[i] % 16, 0u);
      EXPECT_EQ(call.c[i] % 16, 0u);
    }
  }
  ASSERT_EQ(plan.single.size(), 3u);  // the offset one, 300's last 44 rows, 201's last 73
  EXPECT_EQ(plan.single[0].m, 255);
  EXPECT_EQ(plan.single[1].m, 44);
  EXPECT_EQ(plan.single[2].m, 73);
}

// A seeded mix of every transpose, output type, beta, size and alignment.
TEST(BatchPlanTest, RandomMixesMatchTheProductsThemselves) {
  std::mt19937 rng(4);
  for (int round = 0; round < 20; ++round) {
    Products products(100 + round);
    const int count = 2 + static_cast<int>(rng() % 10);
    for (int i = 0; i < count; ++i) {
      const bool ta = rng() % 2, tb = rng() % 2, fp32 = rng() % 2;
      const float beta = rng() % 3 == 0 ? 1.0f : 0.0f;
      const int m = 1 + static_cast<int>(rng() % 400);
      products.Add(ta, tb, m, 8 + round % 3, 8, fp32 ? beta : 0.0f, fp32, false, round % 2);
    }
    SCOPED_TRACE(testing::Message() << "round " << round);
    ExpectPlanMatches(products, PlanBatches(products.list()));
  }
}

}  // namespace
}  // namespace pith::cuda
