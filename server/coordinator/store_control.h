// StoreControl: the coordinator's calls into stores (DESIGN §4, §5), a seam so the
// scheduler's logic can be tested without store processes. grpc_store_control.h is the
// real one; store_control_testing.h is a fake for tests that reach no stores.
//
// Thread safety: implementations are thread-safe; the scheduler calls them from its tick,
// commit, replication and checkpoint threads at once, never with its own lock held.
#ifndef PITH_SERVER_COORDINATOR_STORE_CONTROL_H_
#define PITH_SERVER_COORDINATOR_STORE_CONTROL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pith/v1/common.pb.h"
#include "pith/v1/store.pb.h"

namespace pith::coordinator {

class StoreControl {
 public:
  virtual ~StoreControl() = default;
  // Makes the job's pending versions of `step` on `store` survive a crash of its process,
  // for `attempt` (the assignment version that wrote them); returns how many there are
  // (the caller checks them against what was written there).
  virtual absl::StatusOr<uint64_t> PrepareStep(const v1::MemberInfo& store,
                                               const std::string& job_id, int64_t step,
                                               int64_t attempt) = 0;
  // Makes the job's pending versions of `step` (those `attempt` wrote) current on `store`,
  // the step after step - 1 (idempotent: a retry answers already_committed). The answer
  // says what the store did; the caller checks it.
  virtual absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::MemberInfo& store,
                                                            const std::string& job_id, int64_t step,
                                                            int64_t attempt) = 0;
  // Drops the job's pending versions of `step` on `store` that attempts older than
  // `successor` (the attempt replacing the aborted one) wrote, and fences those attempts.
  virtual absl::Status AbortStep(const v1::MemberInfo& store, const std::string& job_id,
                                 int64_t step, int64_t successor) = 0;
  // The committed blobs of one group on `store` (layer -1: every dense tensor).
  virtual absl::StatusOr<std::vector<v1::BlobInfo>> ListGroup(const v1::MemberInfo& store,
                                                              const std::string& job_id, int layer,
                                                              int expert) = 0;
  // Has `target` copy `keys` (their committed versions) from `source`, store to store
  // over UCX, at most `max_bytes_per_second`. Returns what `target` installed.
  virtual absl::StatusOr<std::vector<v1::BlobInfo>> Pull(const v1::MemberInfo& target,
                                                         const v1::MemberInfo& source,
                                                         const std::vector<v1::BlobKey>& keys,
                                                         uint64_t max_bytes_per_second) = 0;
  // One blob to read into `buffer`; `info` is filled in.
  struct Read {
    v1::BlobKey key;
    int64_t version = -1;  // -1: the committed one
    void* buffer = nullptr;
    size_t capacity = 0;
    v1::BlobInfo info;
  };
  // Reads the committed versions of `reads` from `store` (one batched UCX fetch).
  virtual absl::Status Fetch(const v1::MemberInfo& store, std::vector<Read>& reads) = 0;
  // Garbage collection: the jobs `store` holds blobs of, and the deletion of a job's blobs
  // there (all, one group, or all but the committed weights; see DeleteJobRequest).
  virtual absl::StatusOr<std::vector<v1::StoreJob>> ListJobs(const v1::MemberInfo& store) = 0;
  virtual absl::Status DeleteJob(const v1::MemberInfo& store,
                                 const v1::DeleteJobRequest& request) = 0;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_STORE_CONTROL_H_
