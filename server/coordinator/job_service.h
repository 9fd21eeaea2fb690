// JobServiceImpl: the gRPC adapter of the job API (the client surface). Jobs live in the
// JobRegistry; the rest of the coordinator (scheduling, step commits, heat, cluster state)
// fills them in.
//
// Thread safety: handlers run concurrently on gRPC threads; JobRegistry is thread-safe.
#ifndef PITH_SERVER_COORDINATOR_JOB_SERVICE_H_
#define PITH_SERVER_COORDINATOR_JOB_SERVICE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "pith/v1/job.grpc.pb.h"
#include "security/authorize.h"
#include "server/coordinator/heat_registry.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {

// A download's body: `bytes` bytes of `fd` (`path` names it in errors) from offset 0,
// handed to `send` in chunks of at most `chunk_bytes`. `may_go_on` is asked before every
// chunk (a caller whose token was revoked or expired mid-stream, a cancelled call): its
// first error ends the stream with that error; a `send` that fails (the client is gone)
// ends it CANCELLED.
absl::Status StreamFile(int fd, const std::string& path, uint64_t bytes, size_t chunk_bytes,
                        const std::function<absl::Status()>& may_go_on,
                        const std::function<bool(absl::string_view chunk)>& send);

// Disk room promised to downloads being staged: a download's check counts what the others
// were promised (their files may not be written yet), so that downloads begun together
// do not between them eat into the coordinator's reserve.
//
// Thread safety: thread-safe; mu_ guards the bytes promised.
class StagingLedger {
 public:
  // Promised bytes, given back when it goes (its staging is on disk, or gone, by then).
  class Promise {
   public:
    Promise(Promise&& other) noexcept
        : ledger_(std::exchange(other.ledger_, nullptr)), bytes_(other.bytes_) {}
    Promise& operator=(Promise&&) = delete;
    ~Promise() {
      if (ledger_ != nullptr) ledger_->GiveBack(bytes_);
    }

   private:
    friend class StagingLedger;
    Promise(StagingLedger* ledger, uint64_t bytes) : ledger_(ledger), bytes_(bytes) {}
    StagingLedger* ledger_;
    uint64_t bytes_;
  };
  // `bytes` more under `dir`, promised while the Promise lives, where the disk keeps
  // `reserve` free beside them and every promise outstanding; else RESOURCE_EXHAUSTED.
  absl::StatusOr<Promise> Take(const std::string& dir, uint64_t reserve, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void GiveBack(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Mutex mu_;
  uint64_t promised_ ABSL_GUARDED_BY(mu_) = 0;
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  // `scheduler` may be null (no replication figures in ClusterStatus). A download is
  // exported under `staging_dir` (the coordinator's data dir), streamed, and removed;
  // CheckpointJob writes only under `export_root` (ExportPath; empty: it is refused).
  // `enforce`: the server runs mutual TLS, and JobPolicy decides who may call.
  // `tokens`: bearer tokens admitted besides client certificates (security/tokens.h).
  JobServiceImpl(JobRegistry* jobs, Membership* members, HeatRegistry* heat,
                 Scheduler* scheduler = nullptr, std::string staging_dir = "",
                 std::string export_root = "", bool enforce = false,
                 security::Policy::TokenLookup tokens = nullptr,
                 std::shared_ptr<security::ClientLimits> limits = nullptr)
      : jobs_(jobs),
        members_(members),
        heat_(heat),
        scheduler_(scheduler),
        staging_dir_(std::move(staging_dir)),
        export_root_(std::move(export_root)),
        policy_(JobPolicy(enforce, std::move(tokens), std::move(limits))) {}

  // A caller of the user role may have at most `n` unfinished jobs (0: no limit); set
  // before the service serves.
  void set_max_jobs_per_user(int n) { max_jobs_per_user_ = n; }
  // Free bytes a download's staging must leave on the staging disk (0: unchecked); set
  // before the service serves.
  void set_disk_reserve_bytes(uint64_t bytes) { disk_reserve_bytes_ = bytes; }

  // Users and admins call every method of the job API; a user reaches only the jobs it
  // submitted (Job.owner), which the handlers check (AdmitForJob, ListJobs).
  // `limits`: each client's request rate and open streams (watches, downloads).
  static security::Policy JobPolicy(bool enforce, security::Policy::TokenLookup tokens = nullptr,
                                    std::shared_ptr<security::ClientLimits> limits = nullptr);

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* reply) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* reply) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* reply) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* reply) override;
  grpc::Status RemoveJob(grpc::ServerContext* context, const v1::RemoveJobRequest* request,
                         v1::Job* reply) override;
  grpc::Status CheckpointJob(grpc::ServerContext* context, const v1::CheckpointJobRequest* request,
                             v1::CheckpointJobResponse* reply) override;
  grpc::Status DownloadCheckpoint(grpc::ServerContext* context,
                                  const v1::DownloadCheckpointRequest* request,
                                  grpc::ServerWriter<v1::CheckpointChunk>* writer) override;
  grpc::Status ClusterStatus(grpc::ServerContext* context, const v1::ClusterStatusRequest*,
                             v1::ClusterStatusResponse* reply) override;
  grpc::Status ExpertHeat(grpc::ServerContext* context, const v1::ExpertHeatRequest* request,
                          v1::ExpertHeatResponse* reply) override;

  // What ClusterStatus and ExpertHeat answer, without a caller to check: for readers in
  // this process (the dashboard).
  v1::ClusterStatusResponse ClusterView() const;
  absl::StatusOr<v1::ExpertHeatResponse> HeatView(const std::string& job_id, int layer) const;

 private:
  // Admit, and then for a caller of the user role, that job `job_id` is its own:
  // PERMISSION_DENIED naming the method, the job and the caller otherwise, NOT_FOUND for
  // an unknown job (admins: the handler answers). `caller`: as Admit's.
  grpc::Status AdmitForJob(const grpc::ServerContext& context, const std::string& method,
                           const std::string& job_id,
                           std::optional<security::Identity>* caller = nullptr) const;

  JobRegistry* jobs_;
  Membership* members_;
  // Whether the cluster can run a submitted spec (defaults filled; an invalid one passes
  // here, and Submit names its bad field): FitsTheStores and HasCudaWorkersFor.
  absl::Status CanRun(const v1::JobSpec& spec) const;
  // A valid spec whose largest blob some live store would refuse: INVALID_ARGUMENT naming
  // it.
  absl::Status FitsTheStores(const v1::JobSpec& spec) const;
  // FAILED_PRECONDITION for a valid bf16 spec in a cluster without a live CUDA worker (it
  // trains on nothing else; the scheduler gives it CUDA workers only).
  absl::Status HasCudaWorkersFor(const v1::JobSpec& spec) const;
  HeatRegistry* heat_;
  Scheduler* scheduler_;
  const std::string staging_dir_;
  const std::string export_root_;
  const security::Policy policy_;
  int max_jobs_per_user_ = 0;        // set before serving
  uint64_t disk_reserve_bytes_ = 0;  // set before serving
  StagingLedger staging_;            // downloads being staged
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_JOB_SERVICE_H_
