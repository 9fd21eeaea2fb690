#include "worker/runtime/coordinator_link.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"

namespace pith::runtime {
namespace {

// Calls fail at once while the coordinator is unreachable (the step loop then starts over,
// and sees a stop); the member agent's heartbeat on the same channel brings it back.
void SetDeadline(grpc::ClientContext& ctx, absl::Duration deadline) {
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
}

}  // namespace

class CoordinatorLink::Call {
 public:
  Call(CoordinatorLink* link, absl::Duration deadline) : link_(link) {
    SetDeadline(ctx_, deadline);
    absl::MutexLock lock(&link_->mu_);
    if (link_->cancelled_) ctx_.TryCancel();  // the call ends as it starts
    link_->calls_.insert(&ctx_);
  }
  ~Call() {
    absl::MutexLock lock(&link_->mu_);
    link_->calls_.erase(&ctx_);
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  grpc::ClientContext* ctx() { return &ctx_; }

 private:
  CoordinatorLink* const link_;
  grpc::ClientContext ctx_;
};

void CoordinatorLink::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
}

absl::StatusOr<v1::Assignment> CoordinatorLink::GetAssignment(absl::Duration deadline) {
  v1::GetAssignmentRequest req;
  req.set_worker_id(worker_id_);
  v1::Assignment a;
  Call call(this, deadline);
  absl::Status s = FromGrpcStatus(stub_->GetAssignment(call.ctx(), req, &a));
  if (!s.ok()) return s;
  return a;
}

absl::Status CoordinatorLink::ReportStepWritten(v1::StepWrittenRequest request) {
  request.set_worker_id(worker_id_);
  Call call(this, kReportStepDeadline);
  v1::StepWrittenResponse resp;
  return FromGrpcStatus(stub_->ReportStepWritten(call.ctx(), request, &resp));
}

void CoordinatorLink::ReportFailure(const std::string& job_id, int64_t assignment_version,
                                    int64_t step, const absl::Status& why, Failure kind,
                                    const std::string& unreachable_worker) {
  v1::StepWrittenRequest r;
  r.set_job_id(job_id);
  r.set_worker_id(worker_id_);
  r.set_step(step);
  r.set_assignment_version(assignment_version);
  r.set_ok(false);
  r.set_failure(std::string(why.message()));
  r.set_fatal(kind == Failure::kFatal);
  r.set_needs_more_workers(kind == Failure::kNeedsMoreWorkers);
  r.set_full_store_id(DiskFullStore(why));  // a store that refused a put for want of disk
  r.set_unreachable_worker_id(unreachable_worker);
  Call call(this, kReportFailureDeadline);
  v1::StepWrittenResponse resp;
  (void)stub_->ReportStepWritten(call.ctx(), r, &resp);
}

void CoordinatorLink::ReportHeat(const v1::HeatReport& report) {
  Call call(this, kHeatReportDeadline);
  v1::HeatReportResponse resp;
  grpc::Status st = stub_->ReportHeat(call.ctx(), report, &resp);
  if (!st.ok()) VLOG(1) << "heat report: " << st.error_message();
}

absl::StatusOr<v1::StepStatus> CoordinatorLink::WaitStep(const v1::WaitStepRequest& request,
                                                         absl::Duration deadline) {
  v1::StepStatus st;
  absl::Status s = FromGrpcStatus(WaitStepRaw(request, deadline, &st));
  if (!s.ok()) return s;
  return st;
}

grpc::Status CoordinatorLink::WaitStepRaw(const v1::WaitStepRequest& request,
                                          absl::Duration deadline, v1::StepStatus* status) {
  Call call(this, deadline);
  return stub_->WaitStep(call.ctx(), request, status);
}

AbortWatch::AbortWatch(CoordinatorLink* link, std::string job_id, int64_t step, int64_t version,
                       std::function<void(uint64_t version)> abandon, const std::atomic<bool>* stop)
    : link_(link),
      job_id_(std::move(job_id)),
      abandon_(std::move(abandon)),
      stop_(stop),
      step_(step),
      version_(version),
      thread_([this] { Watch(); }) {}

AbortWatch::~AbortWatch() {
  done_ = true;
  thread_.join();
}

void AbortWatch::Watch() {
  const auto pause = [](absl::Duration d) {
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(d));
  };
  const auto stopping = [this] { return stop_ != nullptr && stop_->load(); };
  while (!done_) {
    if (stopping()) {
      // Every attempt from now on is abandoned: the run ends at its next wait on a peer.
      // Again and again: a watch started before the run's setup joined its peer group
      // abandons an attempt the group has not started yet, which the join then starts.
      abandon_(static_cast<uint64_t>(version_.load()));
      pause(kAbortWatchIdle);
      continue;
    }
    v1::WaitStepRequest req;
    req.set_job_id(job_id_);
    req.set_step(step_.load());
    const int64_t version = version_.load();
    req.set_assignment_version(version);
    v1::StepStatus st;
    const grpc::Status rpc = link_->WaitStepRaw(req, kAbortPollDeadline, &st);
    // Abandoned: the step was aborted, or the job went on under another assignment (a
    // worker paused past its lease finds its step long committed without it, and its
    // peers gone to the new attempt: nothing would answer its waits), or it ended.
    const bool aborted = st.committed_step() < req.step() && st.aborted();
    // An ended job's run is gone (its answer carries no assignment version): only a worker
    // whose step is its last committed one ended with it.
    const bool moved_on =
        st.job_ended() ? st.committed_step() != req.step() : st.assignment_version() != version;
    if (rpc.ok() && (aborted || moved_on)) {
      LOG(INFO) << "step " << req.step() << " of job " << job_id_ << " was "
                << (aborted ? absl::StrCat("aborted: ", st.abort_reason())
                            : absl::StrCat("left behind: the job is at step ", st.committed_step(),
                                           st.job_ended() ? ", ended"
                                                          : absl::StrCat(" under attempt ",
                                                                         st.assignment_version())));
      // Only the attempt it watched (an adopted placement's is already newer); then it
      // waits for the next assignment, adopted in place, or the end of this run.
      abandon_(static_cast<uint64_t>(version));
      while (!done_ && !stopping() && version_.load() == version) pause(kAbortWatchIdle);
      continue;
    }
    if (rpc.ok() && st.committed_step() >= req.step()) {
      // Settled: wait for the next step to start.
      while (!done_ && !stopping() && step_.load() == req.step()) pause(kAbortWatchIdle);
    } else if (!rpc.ok() && rpc.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      pause(kAbortWatchRetry);
    }
  }
}

}  // namespace pith::runtime
