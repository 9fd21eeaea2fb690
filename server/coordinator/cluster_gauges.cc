#include "server/coordinator/cluster_gauges.h"

#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace pith::coordinator {
namespace {

// "MEMBER_STATE_DRAINING" -> "draining".
std::string Label(const std::string& enum_name, const std::string& prefix) {
  return absl::AsciiStrToLower(enum_name.substr(prefix.size()));
}

void SetGauge(MetricsRegistry& metrics, const char* name, const char* help,
              const MetricLabels& labels, double value) {
  absl::StatusOr<prometheus::Gauge*> g = metrics.Gauge(name, help, labels);
  if (g.ok()) (*g)->Set(value);
}

// Scrapes an ended job keeps its series (running at 0) before they go: long enough for
// Prometheus to see it end, short enough that ended jobs do not pile up in the exposition.
constexpr int kEndedScrapes = 12;

constexpr char kRunning[] = "pith_coordinator_job_running";
constexpr char kCommitted[] = "pith_coordinator_job_committed_step";

// The jobs seen running, and those that ended with the scrapes left before their series go.
struct Seen {
  absl::Mutex mu;
  std::set<std::string> running ABSL_GUARDED_BY(mu);
  std::map<std::string, int> ended ABSL_GUARDED_BY(mu);
};

void RefreshMembers(MetricsRegistry& metrics, const Membership& members) {
  for (v1::MemberRole role : {v1::MEMBER_ROLE_STORE, v1::MEMBER_ROLE_WORKER}) {
    std::map<v1::MemberState, int> count = {{v1::MEMBER_STATE_ALIVE, 0},
                                            {v1::MEMBER_STATE_DRAINING, 0},
                                            {v1::MEMBER_STATE_DRAINED, 0},
                                            {v1::MEMBER_STATE_DEAD, 0}};
    for (const v1::MemberInfo& m : members.Members(role)) ++count[m.state()];
    for (const auto& [state, n] : count) {
      SetGauge(metrics, "pith_coordinator_members", "Members per role and state",
               {{"role", Label(v1::MemberRole_Name(role), "MEMBER_ROLE_")},
                {"state", Label(v1::MemberState_Name(state), "MEMBER_STATE_")}},
               n);
    }
  }
}

void Refresh(MetricsRegistry& metrics, const Membership& members, const JobRegistry& jobs,
             Seen& seen) {
  RefreshMembers(metrics, members);
  std::map<v1::JobState, int> count = jobs.CountByState();
  for (v1::JobState state : {v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED,
                             v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
    SetGauge(metrics, "pith_coordinator_jobs", "Jobs per state",
             {{"state", Label(v1::JobState_Name(state), "JOB_STATE_")}}, count[state]);
  }
  std::set<std::string> running;
  for (const v1::Job& job : jobs.List({v1::JOB_STATE_RUNNING}, 0)) {
    running.insert(job.job_id());
    SetGauge(metrics, kRunning, "1 while the job runs, 0 once it ended", {{"job", job.job_id()}},
             1);
    SetGauge(metrics, kCommitted, "The job's last committed step", {{"job", job.job_id()}},
             static_cast<double>(job.committed_step()));
  }
  absl::MutexLock lock(&seen.mu);
  for (const std::string& job : seen.running) {
    if (running.count(job) == 0) seen.ended.emplace(job, kEndedScrapes);
  }
  for (auto it = seen.ended.begin(); it != seen.ended.end();) {
    if (--it->second < 0) {
      metrics.RemoveGauge(kRunning, {{"job", it->first}});
      metrics.RemoveGauge(kCommitted, {{"job", it->first}});
      it = seen.ended.erase(it);
      continue;
    }
    SetGauge(metrics, kRunning, "1 while the job runs, 0 once it ended", {{"job", it->first}}, 0);
    // Its last step, committed after the scrape before it ended (the final one).
    if (absl::StatusOr<v1::Job> job = jobs.Get(it->first); job.ok()) {
      SetGauge(metrics, kCommitted, "The job's last committed step", {{"job", it->first}},
               static_cast<double>(job->committed_step()));
    }
    ++it;
  }
  seen.running = std::move(running);
}

}  // namespace

void ExportClusterGauges(MetricsRegistry& metrics, const Membership* members,
                         const JobRegistry* jobs) {
  auto seen = std::make_shared<Seen>();
  metrics.OnScrape([&metrics, members, jobs, seen] { Refresh(metrics, *members, *jobs, *seen); });
}

}  // namespace pith::coordinator
