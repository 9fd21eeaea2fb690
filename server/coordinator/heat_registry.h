// HeatRegistry: one HeatMap per job, fed by the workers' ReportHeat calls and read by
// ExpertHeat and the placement policy. A report for a newer step first decays the map
// (heat = decay * heat + tokens), so a step's reports from several workers add up. The
// step's reports are kept by worker until the next step's: a worker reporting a step again
// (its attempt was aborted and redone) replaces its report, and DropStep forgets them all,
// so heat counts each committed step once.
//
// Thread safety: all methods are thread-safe.
#ifndef PITH_SERVER_COORDINATOR_HEAT_REGISTRY_H_
#define PITH_SERVER_COORDINATOR_HEAT_REGISTRY_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "pith/v1/coordinator.pb.h"
#include "pith/v1/job.pb.h"
#include "server/coordinator/heat_map.h"

namespace pith::coordinator {

class HeatRegistry {
 public:
  // Records every accepted report, as one JSON line, in `dir`/<job>.heat.jsonl (the
  // simulator's --trace input). Empty: no recording.
  void RecordTo(const std::string& dir) {
    absl::MutexLock lock(&mu_);
    trace_dir_ = dir;
  }

  // Adds a report for `job` (whose spec sizes the map). INVALID_ARGUMENT for a report
  // that does not fit the model; FAILED_PRECONDITION for a step older than the map's.
  absl::Status Report(const v1::Job& job, const v1::HeatReport& report);
  // The heat of a job's experts (layer -1: all) and its strongest co-activated pairs.
  // NOT_FOUND before the first report.
  // max_pairs < 0: every pair.
  absl::StatusOr<v1::ExpertHeatResponse> Heat(const std::string& job_id, int layer,
                                              int max_pairs = 20) const;
  // A copy of a job's map; nullopt before the first report.
  std::optional<HeatMap> Snapshot(const std::string& job_id) const;
  // The whole map of a job (every expert, every pair) for persistence; empty before the
  // first report.
  std::string Save(const std::string& job_id) const;
  // Reinstalls a map saved by Save for `job`. DATA_LOSS for bytes that do not parse or
  // do not fit the job's model.
  absl::Status Restore(const v1::Job& job, const std::string& saved);
  // Forgets a job's map.
  void Drop(const std::string& job_id);
  // Forgets the reports of `step` if it is the job's latest (its attempt was aborted).
  void DropStep(const std::string& job_id, int64_t step);

 private:
  struct JobHeat {
    std::unique_ptr<HeatMap> map;  // every step before `step`
    int64_t step = -1;
    std::map<std::string, v1::HeatReport> reports;  // of `step`, by worker
  };
  // The map with the latest step's reports added.
  static HeatMap Current(const JobHeat& heat);
  // Adds the latest step's reports to `map`.
  static void AddReports(const JobHeat& heat, HeatMap& map);
  mutable absl::Mutex mu_;
  std::map<std::string, JobHeat> jobs_ ABSL_GUARDED_BY(mu_);
  std::string trace_dir_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_HEAT_REGISTRY_H_
