// JobHistory: each job's loss curve as the coordinator saw it commit (step, loss, tokens
// per second), for the dashboard. Fed by JobRegistry::OnChange; held in memory only (a
// coordinator restart starts the curves afresh from the next commit) and bounded: past
// kMaxPoints a job's curve keeps every other point, so a job of any length costs at most
// kMaxPoints points, spread over its whole run. Past kMaxJobs curves, the first seen of
// the ended jobs goes (running jobs keep theirs); a removed job's goes at once.
//
// Thread safety: all methods are thread-safe.
#ifndef PITH_SERVER_COORDINATOR_JOB_HISTORY_H_
#define PITH_SERVER_COORDINATOR_JOB_HISTORY_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "pith/v1/job.pb.h"

namespace pith::coordinator {

class JobHistory {
 public:
  static constexpr size_t kMaxPoints = 1024;
  static constexpr size_t kMaxJobs = 64;

  struct Point {
    int64_t step = 0;
    double loss = 0;
    double tokens_per_second = 0;
  };

  // Records the job's committed step if it is new (step >= 1).
  void Observe(const v1::Job& job);
  // The job's points, oldest first (empty for a job never seen committing).
  std::vector<Point> Curve(const std::string& job_id) const;

 private:
  struct Series {
    std::vector<Point> points;
    int64_t stride = 1;  // keep steps that are multiples of it (doubles when full)
    bool ended = false;  // the job was in a final state when last seen
  };

  mutable absl::Mutex mu_;
  std::map<std::string, Series> curves_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);  // first seen first
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_JOB_HISTORY_H_
