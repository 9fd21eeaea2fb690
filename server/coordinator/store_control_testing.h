// For tests: a StoreControl for coordinators that reach no stores. Prepares and commits
// (of every blob written) and aborts succeed, listings and pulls are empty, reads are UNAVAILABLE.
// Stateless: thread-safe.
#ifndef PITH_SERVER_COORDINATOR_STORE_CONTROL_TESTING_H_
#define PITH_SERVER_COORDINATOR_STORE_CONTROL_TESTING_H_

#include <string>
#include <vector>

#include "server/coordinator/store_control.h"

namespace pith::coordinator::testing {

class NoStores final : public StoreControl {
 public:
  absl::StatusOr<uint64_t> PrepareStep(const v1::MemberInfo&, const std::string&, int64_t,
                                       int64_t) override {
    return uint64_t{1} << 40;  // every blob the workers wrote, and more
  }
  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::MemberInfo&, const std::string&,
                                                    int64_t step, int64_t) override {
    v1::CommitStepResponse r;
    r.set_committed_step(step);
    r.set_blobs_committed(uint64_t{1} << 40);  // every blob the workers wrote, and more
    return r;
  }
  absl::Status AbortStep(const v1::MemberInfo&, const std::string&, int64_t, int64_t) override {
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<v1::BlobInfo>> ListGroup(const v1::MemberInfo&, const std::string&,
                                                      int, int) override {
    return std::vector<v1::BlobInfo>();
  }
  absl::StatusOr<std::vector<v1::BlobInfo>> Pull(const v1::MemberInfo&, const v1::MemberInfo&,
                                                 const std::vector<v1::BlobKey>&,
                                                 uint64_t) override {
    return std::vector<v1::BlobInfo>();
  }
  absl::Status Fetch(const v1::MemberInfo&, std::vector<Read>&) override {
    return absl::UnavailableError("no stores in this test");
  }
  absl::StatusOr<std::vector<v1::StoreJob>> ListJobs(const v1::MemberInfo&) override {
    return std::vector<v1::StoreJob>();
  }
  absl::Status DeleteJob(const v1::MemberInfo&, const v1::DeleteJobRequest&) override {
    return absl::OkStatus();
  }
};

}  // namespace pith::coordinator::testing

#endif  // PITH_SERVER_COORDINATOR_STORE_CONTROL_TESTING_H_
