#include "worker/runtime/cluster_worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "server/coordinator/member_agent.h"
#include "server/store/store_client.h"
#include "worker/runtime/coordinator_link.h"
#include "worker/runtime/job_run.h"
#include "worker/runtime/peer_group.h"
#include "worker/runtime/worker_metrics.h"

namespace pith::runtime {

using store::StoreClient;

namespace {

// Cancels `link` once `stop` is set (SIGTERM), for as long as it lives.
class CancelOnStop {
 public:
  CancelOnStop(CoordinatorLink* link, const std::atomic<bool>& stop)
      : thread_([this, link, &stop] {
          while (!stop && !done_) std::this_thread::sleep_for(std::chrono::milliseconds(50));
          if (stop) link->Cancel();
        }) {}
  ~CancelOnStop() {
    done_ = true;
    thread_.join();
  }
  CancelOnStop(const CancelOnStop&) = delete;
  CancelOnStop& operator=(const CancelOnStop&) = delete;

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;  // last: it reads done_
};

// File descriptors a worker keeps free to take a job: its data and scratch files, its
// connections to peers and stores.
constexpr int kFdHeadroom = 64;

// A worker short of file descriptors would fail every job given to it (its data file, its
// peers' connections): its heartbeat's health says so (empty: well), and it counts as
// dead until it has room. `before`: what the last one said (a change is logged).
std::string FdHealth(const std::string& before) {
  const absl::Status fds = CheckFdHeadroom(kFdHeadroom);
  std::string health = fds.ok() ? "" : std::string(fds.message());
  if (health.empty() != before.empty()) {
    LOG_IF(INFO, health.empty()) << "file descriptors free again: this worker takes jobs";
    LOG_IF(ERROR, !health.empty()) << "this worker takes no jobs: " << health;
  }
  return health;
}

}  // namespace

absl::Status RunClusterWorker(const ClusterWorkerOptions& options, MetricsRegistry& registry,
                              const std::atomic<bool>& stop) {
  if (options.coordinator.empty()) return absl::InvalidArgumentError("--coordinator is required");
  ASSIGN_OR_RETURN(WorkerMetrics metrics, MakeWorkerMetrics(registry));
  v1::MemberInfo self;
  self.set_metrics_address(options.metrics_address);
  ASSIGN_OR_RETURN(std::unique_ptr<PeerGroup> peers, PeerGroup::Create());
  ASSIGN_OR_RETURN(std::unique_ptr<StoreClient> client, StoreClient::Create());
  self.set_role(v1::MEMBER_ROLE_WORKER);
  self.set_grpc_address(options.listen);
  self.set_ucx_address(peers->address());
  self.set_capacity_bytes(options.memory_bytes > 0 ? options.memory_bytes : options.cache_bytes);
  self.set_backend(options.backend_kind);
  // Judged while idle only: a job's own descriptors do not make its worker drop it.
  std::atomic<bool> busy{false};
  ASSIGN_OR_RETURN(
      std::unique_ptr<MemberAgent> agent,
      MemberAgent::Start(options.coordinator, options.security, self,
                         [&busy, health = std::string()](v1::MemberInfo* status) mutable {
                           if (!busy) health = FdHealth(health);
                           status->set_health(health);
                         }));
  const char* devices = std::getenv("UCX_NET_DEVICES");  // set by pith-worker's main
  LOG(INFO) << "worker " << agent->member_id() << " joined " << options.coordinator
            << "; UCX devices: " << (devices != nullptr ? devices : "all");
  if (options.on_joined) options.on_joined();
  // The agent's channel, which its heartbeat keeps connected (a worker serves no gRPC port,
  // so nothing else would read a channel of its own while it reconnects).
  auto coordinator = v1::CoordinatorService::NewStub(agent->channel());
  CoordinatorLink link(coordinator.get(), agent->member_id());
  const CancelOnStop cancel_on_stop(&link, stop);
  const auto pause = [] {
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(kAssignmentRetry));
  };
  int failures = 0;  // failed runs in a row (30 s of training restarts it): doubling waits
  // Runs in a row of one attempt (job, assignment version). Its passing failures to load
  // the committed step (a store that heartbeats but does not answer) are reported from the
  // third on: the coordinator counts them, and the job ends with the reason, not never.
  std::pair<std::string, int64_t> attempt;
  int attempt_runs = 0;
  while (!stop) {
    absl::StatusOr<v1::Assignment> a = link.GetAssignment(kIdleAssignmentDeadline);
    if (!a.ok() || a->job_id().empty()) {
      if (!a.ok()) VLOG(1) << "assignment: " << a.status();
      pause();
      continue;
    }
    JobRun run(*a, peers.get(), client.get(), &link, options, &metrics);
    const auto this_attempt = std::make_pair(a->job_id(), a->assignment_version());
    attempt_runs = this_attempt == attempt ? attempt_runs + 1 : 1;
    attempt = this_attempt;
    const absl::Time started = absl::Now();
    busy = true;
    absl::Status s = run.Run(stop, /*report_passing=*/attempt_runs >= 3);
    busy = false;
    failures = s.ok() ? 0 : (absl::Now() - started > absl::Seconds(30) ? 1 : failures + 1);
    if (!s.ok() && stop) {
      LOG(INFO) << "job " << a->job_id() << ": stopped (" << s << ")";
    } else if (!s.ok()) {
      // ABORTED: the attempt ended under the run (a store saw a newer attempt, the step was
      // aborted, the job cancelled or placed anew): news, not a failure of this worker.
      if (absl::IsAborted(s)) {
        LOG(INFO) << "job " << a->job_id() << ": attempt " << a->assignment_version()
                  << " ended under this run (" << s.message() << ")";
      } else {
        LOG(WARNING) << "job " << a->job_id() << ": " << s;
      }
      for (int i = 0; i < (1 << std::min(failures - 1, 5)) && !stop; ++i) pause();
    }
  }
  return absl::OkStatus();
}

}  // namespace pith::runtime
