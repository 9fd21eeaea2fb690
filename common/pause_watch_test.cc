#include "common/pause_watch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace pith {
namespace {

class PauseWatchTest : public ::testing::Test {
 protected:
  // Both clocks move on by `by`, as they do whether or not the process runs.
  void Pass(absl::Duration by) {
    steady_ += by;
    wall_ += by;
  }
  absl::Duration steady_ = absl::Hours(1);
  absl::Time wall_ = absl::FromUnixSeconds(1000);
  PauseWatch watch_{[this] { return steady_; }, [this] { return wall_; }};
};

TEST_F(PauseWatchTest, LooksAtShortIntervalsSeeNoStop) {
  const absl::Time start = wall_;
  for (int i = 0; i < 100; ++i) {
    Pass(absl::Milliseconds(100));
    watch_.Look();
  }
  Pass(PauseWatch::kStop);  // at the limit: a slow look, not a stop
  EXPECT_EQ(watch_.StoppedSince(start), absl::ZeroDuration());
}

TEST_F(PauseWatchTest, AStopCountsOnlyAfterSince) {
  const absl::Time before = wall_;
  Pass(absl::Seconds(10));  // stopped: nobody looked
  watch_.Look();
  EXPECT_EQ(watch_.StoppedSince(before), absl::Seconds(10));
  EXPECT_EQ(watch_.StoppedSince(wall_ - absl::Seconds(4)), absl::Seconds(4));  // its end
  EXPECT_EQ(watch_.StoppedSince(wall_), absl::ZeroDuration());
  // Asking is looking: a stop seen first by a waiting thread counts as well.
  Pass(absl::Seconds(3));
  EXPECT_EQ(watch_.StoppedSince(before), absl::Seconds(13));
  const absl::Time start = wall_ - absl::Seconds(20);
  EXPECT_EQ(start + absl::Seconds(5) + watch_.StoppedSince(start),
            start + absl::Seconds(18));  // a 5-s wait from before both stops
}

// The real thing: a child process stopped (SIGSTOP) for 1.5 s finds that much in the
// process-wide watch when it runs again, and a wait's deadline moved on by it.
TEST(PauseWatchProcessTest, AStoppedProcessSeesItsStop) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const absl::Time start = absl::Now();
    (void)StoppedSince(start);  // starts the watch
    absl::SleepFor(absl::Milliseconds(300));
    raise(SIGSTOP);
    const absl::Duration stopped = StoppedSince(start);
    const absl::Time deadline = RunningDeadline(start, absl::Seconds(1));
    const bool ok = stopped >= absl::Milliseconds(1300) && stopped <= absl::Seconds(5) &&
                    deadline > absl::Now();
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_EQ(kill(child, SIGCONT), 0);
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child did not see its stop";
}

}  // namespace
}  // namespace pith
