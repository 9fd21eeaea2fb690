// The coordinator's read-at-scrape gauges: a job's committed step while it runs, its last
// one once it ended (committed after the scrape before), and the series going after a
// dozen scrapes.
#include "server/coordinator/cluster_gauges.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/job_spec_testing.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace pith::coordinator {
namespace {

// The line of `name{job="job"}` in `text`, or "" when there is none.
std::string Line(const std::string& text, const std::string& name, const std::string& job) {
  const std::string prefix = absl::StrCat(name, "{job=\"", job, "\"} ");
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return "";
  return text.substr(at, text.find('\n', at) - at);
}

TEST(ClusterGaugesTest, AnEndedJobShowsItsLastCommittedStepThenGoes) {
  const std::string dir = ::testing::TempDir() + "/gauges_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<JobRegistry>> jobs = JobRegistry::Open(dir);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  Membership members(absl::Seconds(3));
  MetricsRegistry metrics;
  ExportClusterGauges(metrics, &members, jobs->get());
  v1::JobSpec spec;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(pith::testing::kDesignExampleSpecJson, &spec)
          .ok());
  absl::StatusOr<v1::Job> job = (*jobs)->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  auto set = [&](v1::JobState state, int64_t step) {
    ASSERT_TRUE((*jobs)
                    ->Update(id,
                             [&](v1::Job& j) {
                               j.set_state(state);
                               j.set_committed_step(step);
                               return absl::OkStatus();
                             })
                    .ok());
  };
  set(v1::JOB_STATE_RUNNING, 39);
  std::string text = metrics.Serialize();
  EXPECT_EQ(Line(text, "pith_coordinator_job_committed_step", id),
            absl::StrCat("pith_coordinator_job_committed_step{job=\"", id, "\"} 39"));
  EXPECT_EQ(Line(text, "pith_coordinator_job_running", id),
            absl::StrCat("pith_coordinator_job_running{job=\"", id, "\"} 1"));
  // The last steps commit and the job ends between two scrapes.
  set(v1::JOB_STATE_SUCCEEDED, 60);
  text = metrics.Serialize();
  EXPECT_EQ(Line(text, "pith_coordinator_job_committed_step", id),
            absl::StrCat("pith_coordinator_job_committed_step{job=\"", id, "\"} 60"));
  EXPECT_EQ(Line(text, "pith_coordinator_job_running", id),
            absl::StrCat("pith_coordinator_job_running{job=\"", id, "\"} 0"));
  for (int i = 0; i < 12; ++i) text = metrics.Serialize();
  EXPECT_EQ(Line(text, "pith_coordinator_job_committed_step", id), "");
  EXPECT_EQ(Line(text, "pith_coordinator_job_running", id), "");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pith::coordinator
