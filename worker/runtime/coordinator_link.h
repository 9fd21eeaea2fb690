// The worker's link to the coordinator (DESIGN §5, §6): every RPC a worker makes, each
// bounded by a named deadline, and the abort watch of a job run.
//
// Thread safety: CoordinatorLink's methods may be called from any thread (a gRPC stub
// is thread-safe; the link holds nothing else that changes). AbortWatch runs one thread
// of its own from construction to destruction; SetStep and SetVersion may be called from
// any thread (atomics).
#ifndef PITH_WORKER_RUNTIME_COORDINATOR_LINK_H_
#define PITH_WORKER_RUNTIME_COORDINATOR_LINK_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/step_protocol.h"
#include "pith/v1/coordinator.grpc.pb.h"

namespace pith::runtime {

// GetAssignment while idle: the intake loop polls again after kAssignmentRetry.
inline constexpr absl::Duration kIdleAssignmentDeadline = absl::Seconds(5);
// GetAssignment after a commit under a new assignment version (adopted in place).
inline constexpr absl::Duration kAdoptAssignmentDeadline = absl::Seconds(10);
// ReportStepWritten of a written step (the coordinator may be busy committing others).
inline constexpr absl::Duration kReportStepDeadline = absl::Seconds(60);
// ReportStepWritten of a failure (best effort: the step aborts anyway once leases lapse).
inline constexpr absl::Duration kReportFailureDeadline = absl::Seconds(10);
// ReportHeat (best effort: a lost report only delays a placement).
inline constexpr absl::Duration kHeatReportDeadline = absl::Seconds(5);
// One round of WaitStep while a step settles (the coordinator answers by the caller's
// deadline, below its own cap kWaitStepServerCap): short, so that a stopping worker
// (SIGTERM) sees its stop within a round however long the step takes to settle.
inline constexpr absl::Duration kSettleRound = absl::Seconds(2);
static_assert(kSettleRound < kWaitStepServerCap);
// The abort watch's WaitStep: short, so that it sees a new step or version promptly.
inline constexpr absl::Duration kAbortPollDeadline = absl::Milliseconds(500);
// The abort watch's wait for the step or version it watches to move on.
inline constexpr absl::Duration kAbortWatchIdle = absl::Milliseconds(20);
// The abort watch's pause after a failed WaitStep (other than its deadline).
inline constexpr absl::Duration kAbortWatchRetry = absl::Milliseconds(100);
// The intake loop's pause after no assignment or a failed job run.
inline constexpr absl::Duration kAssignmentRetry = absl::Milliseconds(200);

// Thread safety: every method may be called from any thread.
class CoordinatorLink {
 public:
  CoordinatorLink(v1::CoordinatorService::Stub* stub, std::string worker_id)
      : stub_(stub), worker_id_(std::move(worker_id)) {}

  const std::string& worker_id() const { return worker_id_; }

  // Ends every call in flight (CANCELLED) and fails every later one at once: the worker
  // is stopping, and a coordinator that froze or was cut off mid-call would otherwise
  // hold it up to that call's deadline (a minute for ReportStepWritten).
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);

  // This worker's assignment (an empty job id: none).
  absl::StatusOr<v1::Assignment> GetAssignment(absl::Duration deadline);
  // Step `request.step()` is written (request's worker id is set here).
  absl::Status ReportStepWritten(v1::StepWrittenRequest request);
  // What a failure means for the job (StepWrittenRequest.fatal, .needs_more_workers).
  enum class Failure {
    kRetry,             // another attempt may pass
    kFatal,             // no retry can fix it: the coordinator fails the job
    kNeedsMoreWorkers,  // this worker's share does not fit at this worker count
  };
  // Step `step` failed here with `why`; best effort. `unreachable_worker`: the peer the
  // failure came from, if one (StepWrittenRequest.unreachable_worker_id).
  void ReportFailure(const std::string& job_id, int64_t assignment_version, int64_t step,
                     const absl::Status& why, Failure kind = Failure::kRetry,
                     const std::string& unreachable_worker = "");
  // Best effort.
  void ReportHeat(const v1::HeatReport& report);
  // The step's status, waiting up to `deadline` (and the coordinator's cap) for it to
  // settle.
  absl::StatusOr<v1::StepStatus> WaitStep(const v1::WaitStepRequest& request,
                                          absl::Duration deadline);
  // As WaitStep, with gRPC's status (the abort watch tells its deadline from failures).
  grpc::Status WaitStepRaw(const v1::WaitStepRequest& request, absl::Duration deadline,
                           v1::StepStatus* status);

 private:
  class Call;  // one call's context, cancelled by Cancel while it runs

  v1::CoordinatorService::Stub* stub_;
  const std::string worker_id_;
  absl::Mutex mu_;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);  // in flight
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// While a run sets up and its steps run, asks the coordinator whether its attempt was
// aborted (a peer or store died) or left behind (the job went on under a newer attempt or
// ended, as for a worker paused past its lease): then `abandon(version)` ends every wait
// on a peer at once instead of timing out. So does `stop` (may be null; this process is stopping,
// SIGTERM), within kAbortPollDeadline, whether or not the coordinator answers, and every
// kAbortWatchIdle after that, so that an attempt started after the stop is abandoned too:
// a stopping worker does not wait out a peer that waits for it.
class AbortWatch {
 public:
  AbortWatch(CoordinatorLink* link, std::string job_id, int64_t step, int64_t version,
             std::function<void(uint64_t version)> abandon, const std::atomic<bool>* stop);
  ~AbortWatch();  // stops and joins the thread
  AbortWatch(const AbortWatch&) = delete;
  AbortWatch& operator=(const AbortWatch&) = delete;

  void SetStep(int64_t step) { step_ = step; }
  void SetVersion(int64_t version) { version_ = version; }

 private:
  void Watch();

  CoordinatorLink* const link_;
  const std::string job_id_;
  const std::function<void(uint64_t)> abandon_;
  const std::atomic<bool>* const stop_;
  std::atomic<int64_t> step_;
  std::atomic<int64_t> version_;
  std::atomic<bool> done_{false};
  std::thread thread_;  // last: it reads the members above
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_COORDINATOR_LINK_H_
