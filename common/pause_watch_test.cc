#include "common/pause_watch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace pith {
namespace {

class PauseWatchTest : public ::testing::Test {
 protected:
  // The clock moves on by `by`, as it does whether or not the process runs.
  void Pass(absl::Duration by) { clock_ += by; }
  absl::Duration clock_ = absl::Hours(1);
  PauseWatch watch_{[this] { return clock_; }};
};

TEST_F(PauseWatchTest, LooksAtShortIntervalsSeeNoStop) {
  const absl::Duration start = clock_;
  for (int i = 0; i < 100; ++i) {
    Pass(absl::Milliseconds(100));
    watch_.Look();
  }
  Pass(PauseWatch::kStop);  // at the limit: a slow look, not a stop
  EXPECT_EQ(watch_.StoppedSince(start), absl::ZeroDuration());
}

TEST_F(PauseWatchTest, AStopCountsOnlyAfterSince) {
  const absl::Duration before = clock_;
  Pass(absl::Seconds(10));  // stopped: nobody looked
  watch_.Look();
  EXPECT_EQ(watch_.StoppedSince(before), absl::Seconds(10));
  EXPECT_EQ(watch_.StoppedSince(clock_ - absl::Seconds(4)), absl::Seconds(4));  // its end
  EXPECT_EQ(watch_.StoppedSince(clock_), absl::ZeroDuration());
  // Asking is looking: a stop seen first by a waiting thread counts as well.
  Pass(absl::Seconds(3));
  EXPECT_EQ(watch_.StoppedSince(before), absl::Seconds(13));
  const absl::Duration start = clock_ - absl::Seconds(20);
  // A 5-s wait from before both stops: of the 20 s since, it ran 7: over by 2.
  EXPECT_EQ(absl::Seconds(5) - (clock_ - start) + watch_.StoppedSince(start), absl::Seconds(-2));
}

// The real thing: a child process stopped (SIGSTOP) for 1.5 s finds that much in the
// process-wide watch when it runs again, and a wait's deadline moved on by it.
TEST(PauseWatchProcessTest, AStoppedProcessSeesItsStop) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const absl::Duration start = SteadyNow();
    (void)StoppedSince(start);  // starts the watch
    absl::SleepFor(absl::Milliseconds(300));
    raise(SIGSTOP);
    const absl::Duration stopped = StoppedSince(start);
    // A 1-s wait begun before the stop has time left.
    const bool ok = stopped >= absl::Milliseconds(1300) && stopped <= absl::Seconds(5) &&
                    RunningLeft(start, absl::Seconds(1)) > absl::ZeroDuration();
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
