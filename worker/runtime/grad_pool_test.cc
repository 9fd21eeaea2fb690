// GradPool: gradients beyond its buffers wait in the scratch file and come back intact;
// held ones are never spilled; a pool with every buffer held says so.
#include "worker/runtime/grad_pool.h"

#include <vector>

#include "gtest/gtest.h"

namespace pith::runtime {
namespace {

constexpr int64_t kFloats = 1000;

float Value(int expert, int64_t i) { return static_cast<float>(expert * 10000 + i) * 0.5f; }

TEST(GradPoolTest, GradientsBeyondTheBuffersSpillAndComeBackIntact) {
  auto pool = GradPool::Create(kFloats, 3, ::testing::TempDir());
  ASSERT_TRUE(pool.ok()) << pool.status();
  GradPool& p = **pool;
  for (int step = 0; step < 2; ++step) {
    // A backward over 10 experts, one open at a time.
    for (int e = 0; e < 10; ++e) {
      auto g = p.Open({0, e});
      ASSERT_TRUE(g.ok()) << g.status();
      for (int64_t i = 0; i < kFloats; ++i) {
        EXPECT_EQ((*g)[i], 0.0f);  // opened zeroed, whatever the buffer held before
        (*g)[i] += Value(e + step, i);
      }
      p.Close({0, e});
    }
    EXPECT_GE(p.stats().spills, static_cast<uint64_t>(7 * (step + 1)));
    // Read twice (the norm's pass, say): the second pass writes nothing, since what it
    // evicts is unchanged since it was read back (the first pass evicts the last three
    // opened, never written yet).
    for (int pass = 0; pass < 2; ++pass) {
      const uint64_t spills_before = p.stats().spills;
      for (int e = 0; e < 10; ++e) {
        auto g = p.Acquire({0, e});
        ASSERT_TRUE(g.ok()) << g.status();
        for (int64_t i = 0; i < kFloats; ++i) {
          ASSERT_EQ((*g)[i], Value(e + step, i)) << e << " " << i;
        }
        p.Release({0, e});
      }
      EXPECT_LE(p.stats().spills - spills_before, pass == 0 ? 3u : 0u) << "pass " << pass;
    }
    // Changed in place in another order (a replica sum): spilled again as it is.
    for (int e = 9; e >= 0; --e) {
      auto g = p.Acquire({0, e}, GradPool::Use::kUpdate);
      ASSERT_TRUE(g.ok()) << g.status();
      (*g)[0] = -1;
      p.Release({0, e});
    }
    // Applied one by one and dropped: each is read as changed, and then gone.
    for (int e = 0; e < 10; ++e) {
      auto g = p.Acquire({0, e}, GradPool::Use::kUpdate);
      ASSERT_TRUE(g.ok());
      EXPECT_EQ((*g)[0], -1.0f);
      EXPECT_EQ((*g)[1], Value(e + step, 1));
      p.Release({0, e}, /*drop=*/true);
      EXPECT_FALSE(p.Has({0, e}));
    }
    EXPECT_FALSE(p.Has({1, 0}));
    EXPECT_EQ(p.Acquire({1, 0}).status().code(), absl::StatusCode::kNotFound);
    // An expert with no rows here, updated anyway (a replica's primary): zeros.
    auto zeros = p.Acquire({1, 0}, GradPool::Use::kUpdate);
    ASSERT_TRUE(zeros.ok());
    EXPECT_EQ((*zeros)[7], 0.0f);
    p.Release({1, 0});
    p.Reset();
    EXPECT_FALSE(p.Has({0, 0}));
    EXPECT_FALSE(p.Has({1, 0}));
  }
  EXPECT_EQ(p.bytes(), 3 * kFloats * sizeof(float));
}

TEST(GradPoolTest, HeldGradientsStayAndAFullPoolSaysSo) {
  auto pool = GradPool::Create(kFloats, 2, ::testing::TempDir());
  ASSERT_TRUE(pool.ok());
  GradPool& p = **pool;
  auto a = p.Open({0, 0});
  ASSERT_TRUE(a.ok());
  (*a)[5] = 7;
  p.Close({0, 0});
  auto held = p.Acquire({0, 0});
  ASSERT_TRUE(held.ok());
  auto b = p.Open({0, 1});
  ASSERT_TRUE(b.ok());
  // Both buffers held: nothing can spill.
  auto c = p.Open({0, 2});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_EQ((*held)[5], 7.0f);
  EXPECT_EQ(p.Open({0, 1}).status().code(), absl::StatusCode::kFailedPrecondition);
  p.Release({0, 0});
  p.Close({0, 1});
  ASSERT_TRUE(p.Open({0, 2}).ok());
  EXPECT_EQ(GradPool::Create(kFloats, 1, ::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto nowhere = GradPool::Create(kFloats, 2, "/nonexistent/dir");
  ASSERT_TRUE(nowhere.ok());
  for (int e = 0; e < 2; ++e) {
    ASSERT_TRUE((*nowhere)->Open({0, e}).ok());
    (*nowhere)->Close({0, e});
  }
  auto spill = (*nowhere)->Open({0, 2});
  EXPECT_EQ(spill.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(spill.status().message().find("/nonexistent/dir"), std::string::npos);
}

}  // namespace
}  // namespace pith::runtime
