#include "worker/compute/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace pith::compute {
namespace {

// Every index in [0, n) is visited exactly once, for any size, grain and pool width.
TEST(ThreadPoolTest, CoversTheRangeExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {0, 1, 2, 7, 64, 1000, 100003}) {
      for (int64_t grain : {1, 16, 100000}) {
        std::vector<std::atomic<int>> seen(n);
        pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
          ASSERT_LE(0, begin);
          ASSERT_LE(begin, end);
          ASSERT_LE(end, n);
          for (int64_t i = begin; i < end; ++i) seen[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(seen[i].load(), 1) << n << " " << grain << " " << i;
      }
    }
  }
}

TEST(ThreadPoolTest, RunsOnSeveralThreadsWhenTheWorkIsLarge) {
  ThreadPool pool(2);
  std::atomic<int> calls{0};
  pool.ParallelFor(1 << 20, 1, [&](int64_t, int64_t) { calls.fetch_add(1); });
  EXPECT_EQ(calls.load(), 2);
  calls = 0;
  pool.ParallelFor(10, 100, [&](int64_t, int64_t) { calls.fetch_add(1); });
  EXPECT_EQ(calls.load(), 1);  // below the grain: inline
}

}  // namespace
}  // namespace pith::compute
