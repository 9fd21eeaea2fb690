#include "worker/runtime/task_threads.h"

#include <atomic>
#include <future>
#include <vector>

#include "gtest/gtest.h"

namespace pith::runtime {
namespace {

TEST(TaskThreadsTest, RunsTasksAndReturnsResults) {
  TaskThreads t;
  std::vector<std::future<int>> results;
  for (int i = 0; i < 20; ++i) results.push_back(t.Async([i] { return i * i; }));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(results[i].get(), i * i);
}

TEST(TaskThreadsTest, ATaskMayWaitForOneSubmittedAfterIt) {
  TaskThreads t;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  // The first task blocks until the second has run: it needs a thread of its own.
  std::future<bool> first = t.Async([released] {
    released.wait();
    return true;
  });
  std::future<void> second = t.Async([&release] { release.set_value(); });
  second.get();
  EXPECT_TRUE(first.get());
}

TEST(TaskThreadsTest, ThreadsAreReusedOnceIdle) {
  TaskThreads t;
  for (int round = 0; round < 50; ++round) {
    std::future<int> a = t.Async([] { return 1; });
    std::future<int> b = t.Async([] { return 2; });
    EXPECT_EQ(a.get() + b.get(), 3);
  }
  // Two run at a time; a thread that has set its future may not be idle yet when the
  // next round starts, so a few more may be started, never one per task.
  EXPECT_LT(t.threads(), 50);
}

TEST(TaskThreadsTest, DestructorRunsWhatIsQueued) {
  std::atomic<int> ran{0};
  {
    TaskThreads t;
    for (int i = 0; i < 10; ++i) t.Run([&ran] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST(TaskThreadsTest, MoveOnlyTasks) {
  TaskThreads t;
  std::promise<int> p;
  std::future<int> got = p.get_future();
  std::future<void> done = t.Async([p = std::move(p)]() mutable { p.set_value(7); });
  done.get();
  EXPECT_EQ(got.get(), 7);
}

}  // namespace
}  // namespace pith::runtime
