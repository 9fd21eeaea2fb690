// JobRegistry: the coordinator's record of every job, durable in its embedded RocksDB.
// Submitting validates the spec (the bad field is named), cancelling ends a job, and
// watchers are woken on every change. Survives kill -9: each change is a synced write.
//
// Thread safety: all methods are thread-safe.
#ifndef PITH_SERVER_COORDINATOR_JOB_REGISTRY_H_
#define PITH_SERVER_COORDINATOR_JOB_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/job_state.h"
#include "pith/v1/job.pb.h"

namespace rocksdb {
class DB;
}

namespace pith::coordinator {

class JobRegistry {
 public:
  // Opens (creating if needed) the registry in `data_dir` and loads every job. Jobs are
  // admitted while the coordinator's estimated state for every unfinished one
  // (JobStateBytes) stays within `jobs_memory_bytes` (0: no limit).
  static absl::StatusOr<std::unique_ptr<JobRegistry>> Open(const std::string& data_dir,
                                                           uint64_t jobs_memory_bytes = 0);
  ~JobRegistry();

  // Fills defaults, validates (INVALID_ARGUMENT naming the field) and records a new job in
  // JOB_STATE_PENDING. RESOURCE_EXHAUSTED when the coordinator could not hold it beside
  // the unfinished jobs, or when `owner` has `owner_limit` unfinished jobs already (0: no
  // limit); the job is not recorded. `owner`: who submitted it (Job.owner).
  absl::StatusOr<v1::Job> Submit(v1::JobSpec spec, std::string owner = "", int owner_limit = 0);
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const;
  // Newest first; `states` empty means all; `limit` 0 means no limit; with `owner`, only
  // the jobs it submitted.
  std::vector<v1::Job> List(const std::vector<v1::JobState>& states, int limit,
                            const std::optional<std::string>& owner = std::nullopt) const;
  // How many jobs are in each state (without copying them).
  std::map<v1::JobState, int> CountByState() const;
  // Ends a pending or running job as cancelled. FAILED_PRECONDITION for a finished one.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason);
  // Removes an ended job: Get, List, Update, Cancel and WaitForChange no longer find it
  // (NOT_FOUND, saying it was removed). FAILED_PRECONDITION for a job still pending or
  // running, NOT_FOUND for an unknown or removed one. A durable tombstone stays (the id,
  // owner, state and times, a few dozen bytes): the garbage collector deletes the job's
  // blobs from a store that was away when it is back, and ids are never reused. Returns
  // the job's last record.
  absl::StatusOr<v1::Job> Remove(const std::string& job_id);
  // True when `job_id` names a removed job.
  bool Removed(const std::string& job_id) const;
  // Who submitted the job (Job.owner), removed or not; NOT_FOUND for an unknown id.
  absl::StatusOr<std::string> Owner(const std::string& job_id) const;
  // Applies `update` to a job and records it (for the scheduler and step commits).
  absl::StatusOr<v1::Job> Update(const std::string& job_id,
                                 const std::function<absl::Status(v1::Job&)>& update);

  // Waits until the job's record differs from `seen` (by version) or `timeout` passes;
  // returns the current record. NOT_FOUND for an unknown job.
  absl::StatusOr<v1::Job> WaitForChange(const std::string& job_id, int64_t seen_version,
                                        absl::Duration timeout) const;
  // A job's change counter (bumped by every Update/Cancel).
  int64_t Version(const std::string& job_id) const;

  // Calls `observer` after every change of a job (submitted, updated, cancelled) with the
  // job as recorded, under the registry's lock: it must be quick and must not call the
  // registry. Set before the registry is shared.
  void OnChange(std::function<void(const v1::Job&)> observer);

  // Side records of the rest of the coordinator (schedules, heat), durable on return,
  // in the same store: `key` must not start with "job/" or "meta/".
  absl::Status PutRecord(const std::string& key, const std::string& value);
  absl::Status DeleteRecord(const std::string& key);
  // Every record whose key starts with `prefix`, by key.
  absl::StatusOr<std::map<std::string, std::string>> Records(const std::string& prefix) const;

 private:
  JobRegistry() = default;
  absl::Status Persist(const v1::Job& job);

  // RESOURCE_EXHAUSTED when `spec` does not fit beside the unfinished jobs.
  absl::Status AdmitLocked(const v1::JobSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<rocksdb::DB> db_;
  uint64_t jobs_memory_bytes_ = 0;  // set once at Open
  mutable absl::Mutex mu_;
  // NOT_FOUND for `job_id`: removed, or never known.
  absl::Status NoJobLocked(const std::string& job_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  std::map<std::string, v1::Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::Job> removed_ ABSL_GUARDED_BY(mu_);  // tombstones
  std::map<std::string, int64_t> versions_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::function<void(const v1::Job&)> observer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_JOB_REGISTRY_H_
