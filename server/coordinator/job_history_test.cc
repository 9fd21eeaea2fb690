#include "server/coordinator/job_history.h"

#include <string>

#include "gtest/gtest.h"

namespace pith::coordinator {
namespace {

v1::Job Committed(const std::string& id, int64_t step) {
  v1::Job job;
  job.set_job_id(id);
  job.set_committed_step(step);
  job.set_last_loss(10.0 / step);
  job.set_tokens_per_second(100.0 * step);
  return job;
}

TEST(JobHistoryTest, RecordsEachCommitOnce) {
  JobHistory h;
  h.Observe(Committed("a", 0));  // initial weights: no loss yet
  h.Observe(Committed("a", 1));
  h.Observe(Committed("a", 1));  // the same step again (another field changed)
  h.Observe(Committed("a", 2));
  const std::vector<JobHistory::Point> c = h.Curve("a");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].step, 1);
  EXPECT_DOUBLE_EQ(c[0].loss, 10.0);
  EXPECT_EQ(c[1].step, 2);
  EXPECT_DOUBLE_EQ(c[1].tokens_per_second, 200.0);
  EXPECT_TRUE(h.Curve("b").empty());
}

TEST(JobHistoryTest, ARemovedJobsCurveGoes) {
  JobHistory h;
  h.Observe(Committed("a", 1));
  h.Observe(Committed("b", 1));
  v1::Job tombstone;
  tombstone.set_job_id("a");
  tombstone.set_removed_unix_ms(1);
  h.Observe(tombstone);
  EXPECT_TRUE(h.Curve("a").empty());
  EXPECT_EQ(h.Curve("b").size(), 1u);
}

TEST(JobHistoryTest, ALongJobKeepsABoundedCurveOverItsWholeRun) {
  JobHistory h;
  const int64_t steps = 100000;
  for (int64_t s = 1; s <= steps; ++s) h.Observe(Committed("long", s));
  const std::vector<JobHistory::Point> c = h.Curve("long");
  EXPECT_LE(c.size(), JobHistory::kMaxPoints);
  EXPECT_GE(c.size(), JobHistory::kMaxPoints / 4);
  EXPECT_LE(c.front().step, steps / 100);  // the start is still there
  EXPECT_GE(c.back().step, steps - steps / 100);
  for (size_t i = 1; i < c.size(); ++i) EXPECT_LT(c[i - 1].step, c[i].step);
}

TEST(JobHistoryTest, DropsEndedJobsFirstThenTheOldest) {
  JobHistory h;
  h.Observe(Committed("running", 1));
  for (size_t j = 0; j < JobHistory::kMaxJobs + 2; ++j) {
    v1::Job ended = Committed("job-" + std::to_string(j), 1);
    ended.set_state(v1::JOB_STATE_SUCCEEDED);
    h.Observe(ended);
  }
  EXPECT_FALSE(h.Curve("running").empty());  // older than all, but still running
  EXPECT_TRUE(h.Curve("job-0").empty());
  EXPECT_TRUE(h.Curve("job-2").empty());  // 1 + kMaxJobs + 2 jobs: three went
  EXPECT_FALSE(h.Curve("job-3").empty());
  JobHistory all_running;
  for (size_t j = 0; j < JobHistory::kMaxJobs + 1; ++j) {
    all_running.Observe(Committed("job-" + std::to_string(j), 1));
  }
  EXPECT_TRUE(all_running.Curve("job-0").empty());
  EXPECT_FALSE(all_running.Curve("job-1").empty());
}

}  // namespace
}  // namespace pith::coordinator
