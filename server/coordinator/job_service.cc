#include "server/coordinator/job_service.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/export_path.h"
#include "common/file.h"
#include "common/grpc_util.h"
#include "common/job_spec.h"
#include "common/param_layout.h"
#include "common/status.h"
#include "pith/v1/spec.pb.h"

namespace pith::coordinator {
namespace {

// A job's latest figures, with its five hottest experts as the heat summary.
v1::JobEvent EventOf(const v1::Job& job, const HeatRegistry& heat) {
  v1::JobEvent e;
  e.set_job_id(job.job_id());
  e.set_state(job.state());
  e.set_step(job.committed_step());
  e.set_loss(job.last_loss());
  e.set_ce(job.last_ce());
  e.set_lr(job.last_lr());
  e.set_tokens_per_second(job.tokens_per_second());
  e.set_cache_hit_rate(job.cache_hit_rate());
  e.set_step_seconds(job.step_seconds());
  e.set_placement_epoch(job.placement_epoch());
  e.set_message(!job.failure_reason().empty() ? job.failure_reason() : job.pending_reason());
  absl::StatusOr<v1::ExpertHeatResponse> h = heat.Heat(job.job_id(), -1, /*max_pairs=*/0);
  if (h.ok()) {
    std::vector<v1::ExpertHeatEntry> all(h->experts().begin(), h->experts().end());
    const size_t n = std::min<size_t>(5, all.size());
    std::partial_sort(all.begin(), all.begin() + n, all.end(),
                      [](const v1::ExpertHeatEntry& a, const v1::ExpertHeatEntry& b) {
                        return a.heat() > b.heat();
                      });
    for (size_t i = 0; i < n; ++i) *e.add_hottest() = all[i];
  }
  return e;
}

}  // namespace

absl::StatusOr<StagingLedger::Promise> StagingLedger::Take(const std::string& dir, uint64_t reserve,
                                                           uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  // The others' promises count as writes to come (their files may not be on disk yet).
  if (absl::Status room = CheckDiskRoom(dir, reserve, bytes + promised_); !room.ok()) {
    if (promised_ == 0) return room;
    return absl::Status(room.code(), absl::StrCat(room.message(), " (", promised_,
                                                  " bytes of that write promised to downloads "
                                                  "being staged)"));
  }
  promised_ += bytes;
  return Promise(this, bytes);
}

void StagingLedger::GiveBack(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  promised_ -= bytes;
}

absl::Status StreamFile(int fd, const std::string& path, uint64_t bytes, size_t chunk_bytes,
                        const std::function<absl::Status()>& may_go_on,
                        const std::function<bool(absl::string_view chunk)>& send) {
  if (chunk_bytes == 0) return absl::InvalidArgumentError("StreamFile: chunks of 0 bytes");
  std::string buffer(std::min<uint64_t>(chunk_bytes, bytes), '\0');
  uint64_t sent = 0;
  while (sent < bytes) {
    RETURN_IF_ERROR(may_go_on());
    const size_t n = std::min<uint64_t>(buffer.size(), bytes - sent);
    RETURN_IF_ERROR(PreadAll(fd, {reinterpret_cast<uint8_t*>(buffer.data()), n}, sent, path));
    if (!send(absl::string_view(buffer.data(), n))) return absl::CancelledError("client gone");
    sent += n;
  }
  return absl::OkStatus();
}

absl::Status JobServiceImpl::CanRun(const v1::JobSpec& submitted) const {
  v1::JobSpec spec = submitted;
  ApplyJobSpecDefaults(&spec);
  if (!ValidateJobSpec(spec).ok()) return absl::OkStatus();  // Submit names the bad field
  RETURN_IF_ERROR(FitsTheStores(spec));
  return HasCudaWorkersFor(spec);
}

absl::Status JobServiceImpl::FitsTheStores(const v1::JobSpec& spec) const {
  const int64_t largest = model::ModelShape::FromSpec(spec.model()).largest_blob_bytes();
  for (const v1::MemberInfo& store : members_->Members(v1::MEMBER_ROLE_STORE)) {
    if (store.state() == v1::MEMBER_STATE_DEAD || store.max_blob_bytes() == 0) continue;
    if (static_cast<uint64_t>(largest) > store.max_blob_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("JobSpec model: its largest blob (an expert or a dense tensor) is ", largest,
                       " bytes, more than store ", store.member_id(),
                       "'s --max_blob_bytes=", store.max_blob_bytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status JobServiceImpl::HasCudaWorkersFor(const v1::JobSpec& spec) const {
  if (!Scheduler::NeedsCuda(spec)) return absl::OkStatus();
  // Alive as the scheduler counts them (Snapshot): in the cluster and healthy.
  for (const auto& [id, w] : Snapshot(*members_).workers) {
    if (w.backend() == v1::BACKEND_CUDA) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "JobSpec model.compute_dtype: bf16 trains on CUDA workers (pith-worker --backend=cuda) "
      "and this cluster has none alive; submit it as fp32, or start CUDA workers first");
}

security::Policy JobServiceImpl::JobPolicy(bool enforce, security::Policy::TokenLookup tokens,
                                           std::shared_ptr<security::ClientLimits> limits) {
  const std::set<security::Role> people = {security::Role::kUser, security::Role::kAdmin};
  std::map<std::string, std::set<security::Role>> rules;
  for (const char* method :
       {"SubmitJob", "GetJob", "ListJobs", "WatchJob", "CancelJob", "RemoveJob", "CheckpointJob",
        "DownloadCheckpoint", "ClusterStatus", "ExpertHeat"}) {
    rules[method] = people;
  }
  return security::Policy(enforce, std::move(rules), std::move(tokens), std::move(limits));
}

grpc::Status JobServiceImpl::AdmitForJob(const grpc::ServerContext& context,
                                         const std::string& method, const std::string& job_id,
                                         std::optional<security::Identity>* caller) const {
  std::optional<security::Identity> who;
  if (grpc::Status denied = policy_.Admit(context, method, &who); !denied.ok()) return denied;
  if (caller != nullptr) *caller = who;
  // Ids are a spec name (64 bytes at most) and a number: anything else is refused before
  // it is echoed back in an error (a 4000-byte id overflowed gRPC's metadata; a newline or
  // an escape sequence reached the caller's terminal).
  constexpr size_t kMaxJobIdBytes = 96;
  if (job_id.empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(method, ": no job id given")));
  }
  if (job_id.size() > kMaxJobIdBytes) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        method, ": a job id of ", job_id.size(), " bytes; ids are at most ", kMaxJobIdBytes)));
  }
  if (!std::all_of(job_id.begin(), job_id.end(), IsNameChar)) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        method,
        ": a job id holds only letters, digits, '-', '_' and '.' (a spec name and a number)")));
  }
  if (!who.has_value() || who->role != security::Role::kUser) return grpc::Status::OK;
  absl::StatusOr<std::string> owner = jobs_->Owner(job_id);
  // Unknown now is unknown to this call: a job submitted after this check (ids are
  // predictable) is not reached through it. Owners never change, a removed job's neither
  // (another user learns nothing of it, its end included).
  if (!owner.ok()) return ToGrpcStatus(owner.status());
  if (*owner == who->name) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat(method, ": job ", job_id, " was not submitted by the caller, ",
                   security::DebugString(*who), "; a user reaches only the jobs it submitted"));
}

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const v1::SubmitJobRequest* request,
                                       v1::SubmitJobResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "SubmitJob", &caller); !denied.ok())
    return denied;
  if (!request->has_spec())
    return ToGrpcStatus(absl::InvalidArgumentError("JobSpec: spec is required"));
  if (absl::Status can = CanRun(request->spec()); !can.ok()) return ToGrpcStatus(can);
  const bool user = caller.has_value() && caller->role == security::Role::kUser;
  absl::StatusOr<v1::Job> job = jobs_->Submit(
      request->spec(), caller.has_value() ? caller->name : "", user ? max_jobs_per_user_ : 0);
  if (!job.ok()) return ToGrpcStatus(job.status());
  *reply->mutable_job() = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                                    v1::Job* reply) {
  if (grpc::Status denied = AdmitForJob(*context, "GetJob", request->job_id()); !denied.ok())
    return denied;
  return ToGrpcReply(jobs_->Get(request->job_id()), reply);
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const v1::ListJobsRequest* request,
                                      v1::ListJobsResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "ListJobs", &caller); !denied.ok())
    return denied;
  if (request->limit() < 0) return ToGrpcStatus(absl::InvalidArgumentError("limit must be >= 0"));
  std::vector<v1::JobState> states;
  for (int s : request->states()) states.push_back(static_cast<v1::JobState>(s));
  std::optional<std::string> owner;  // a user lists its own jobs
  if (caller.has_value() && caller->role == security::Role::kUser) owner = caller->name;
  for (v1::Job& job : jobs_->List(states, request->limit(), owner)) {
    *reply->add_jobs() = std::move(job);
  }
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* context,
                                      const v1::WatchJobRequest* request,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = AdmitForJob(*context, "WatchJob", request->job_id(), &caller);
      !denied.ok())
    return denied;
  absl::StatusOr<security::ClientLimits::StreamSlot> stream = policy_.OpenStream(*context, caller);
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  absl::StatusOr<v1::Job> job = jobs_->Get(request->job_id());
  if (!job.ok()) return ToGrpcStatus(job.status());
  int64_t seen = jobs_->Version(request->job_id());
  if (!writer->Write(EventOf(*job, *heat_))) return grpc::Status::OK;
  while (!IsFinal(job->state()) && !context->IsCancelled()) {
    // The caller's token may expire or be revoked while it watches: the stream ends then.
    if (absl::StatusOr<std::optional<security::Identity>> still =
            policy_.Check(*context, "WatchJob");
        !still.ok()) {
      return ToGrpcStatus(still.status());
    }
    job = jobs_->WaitForChange(request->job_id(), seen, absl::Milliseconds(500));
    if (!job.ok()) return ToGrpcStatus(job.status());
    const int64_t now = jobs_->Version(request->job_id());
    if (now == seen) continue;
    seen = now;
    if (!writer->Write(EventOf(*job, *heat_))) break;
  }
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const v1::CancelJobRequest* request, v1::Job* reply) {
  if (grpc::Status denied = AdmitForJob(*context, "CancelJob", request->job_id()); !denied.ok())
    return denied;
  // Recorded and shown to whoever reads the job (an admin's terminal included).
  constexpr size_t kMaxReasonBytes = 512;
  const std::string& reason = request->reason();
  if (reason.size() > kMaxReasonBytes || HasControlCharacter(reason)) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "CancelJob: a reason is at most ", kMaxReasonBytes, " bytes, without control characters")));
  }
  return ToGrpcReply(jobs_->Cancel(request->job_id(), request->reason()), reply);
}

grpc::Status JobServiceImpl::RemoveJob(grpc::ServerContext* context,
                                       const v1::RemoveJobRequest* request, v1::Job* reply) {
  if (grpc::Status denied = AdmitForJob(*context, "RemoveJob", request->job_id()); !denied.ok())
    return denied;
  return ToGrpcReply(scheduler_ != nullptr ? scheduler_->Remove(request->job_id())
                                           : jobs_->Remove(request->job_id()),
                     reply);
}

grpc::Status JobServiceImpl::CheckpointJob(grpc::ServerContext* context,
                                           const v1::CheckpointJobRequest* request,
                                           v1::CheckpointJobResponse* reply) {
  if (grpc::Status denied = AdmitForJob(*context, "CheckpointJob", request->job_id()); !denied.ok())
    return denied;
  if (scheduler_ == nullptr) {
    return ToGrpcStatus(absl::UnavailableError("this coordinator reaches no stores"));
  }
  if (absl::StatusOr<v1::Job> job = jobs_->Get(request->job_id()); !job.ok()) {
    return ToGrpcStatus(job.status());  // an unknown job first, whatever the path
  }
  if (request->output_dir().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("output_dir is required"));
  }
  absl::StatusOr<ExportPath> dir = ExportPath::Directory(export_root_, request->output_dir());
  if (!dir.ok()) return ToGrpcStatus(dir.status());
  v1::CheckpointJobRequest confined = *request;
  confined.set_output_dir(dir->path());
  absl::StatusOr<v1::CheckpointJobResponse> exported = scheduler_->Checkpoint(confined);
  if (exported.ok()) {  // named as the caller knows it, not through the open directory
    exported->set_weights_path(absl::StrCat(
        dir->shown(), "/", std::filesystem::path(exported->weights_path()).filename().string()));
  } else {  // so are errors
    exported = dir->Named(exported.status());
  }
  return ToGrpcReply(std::move(exported), reply);
}

grpc::Status JobServiceImpl::DownloadCheckpoint(grpc::ServerContext* context,
                                                const v1::DownloadCheckpointRequest* request,
                                                grpc::ServerWriter<v1::CheckpointChunk>* writer) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = AdmitForJob(*context, "DownloadCheckpoint", request->job_id(), &caller);
      !denied.ok())
    return denied;
  absl::StatusOr<security::ClientLimits::StreamSlot> stream = policy_.OpenStream(*context, caller);
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  if (scheduler_ == nullptr || staging_dir_.empty()) {
    return ToGrpcStatus(absl::UnavailableError("this coordinator reaches no stores"));
  }
  // The whole export lands on the coordinator's disk first: it must leave the reserve its
  // RocksDB needs (a job's weights are 4 bytes a parameter), beside downloads being staged.
  std::optional<StagingLedger::Promise> room;
  if (disk_reserve_bytes_ > 0) {
    absl::StatusOr<v1::Job> job = jobs_->Get(request->job_id());
    if (!job.ok()) return ToGrpcStatus(job.status());
    const uint64_t weights =
        4 *
        static_cast<uint64_t>(
            model::ParamLayout(model::ModelShape::FromSpec(job->spec().model())).total_floats());
    std::error_code made;
    std::filesystem::create_directories(staging_dir_, made);
    absl::StatusOr<StagingLedger::Promise> promised =
        staging_.Take(staging_dir_, disk_reserve_bytes_, weights);
    if (!promised.ok()) {
      return ToGrpcStatus(absl::Status(
          promised.status().code(),
          absl::StrCat("the coordinator cannot stage the checkpoint (", weights,
                       " bytes) under its --data_dir: ", promised.status().message())));
    }
    room.emplace(std::move(*promised));
  }
  // Exported into a folder of its own, opened, and removed before the first byte goes
  // out: the open descriptor keeps the file until the stream ends, however it ends.
  static std::atomic<uint64_t> downloads{0};
  const std::string dir = absl::StrCat(staging_dir_, "/download-", ::getpid(), "-", ++downloads);
  v1::CheckpointJobRequest export_request;
  export_request.set_job_id(request->job_id());
  export_request.set_output_dir(dir);
  absl::StatusOr<v1::CheckpointJobResponse> exported = scheduler_->Checkpoint(export_request);
  UniqueFd fd;
  if (exported.ok()) fd = UniqueFd(::open(exported->weights_path().c_str(), O_RDONLY | O_CLOEXEC));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  room.reset();  // the file is written (and open), or gone: the disk's figures count it
  if (!exported.ok()) {
    // A path in the staging folder is the coordinator's, not one the caller gave: said so
    // (a full disk under the coordinator reads otherwise as the caller's own).
    const std::string message(exported.status().message());
    if (!absl::StrContains(message, dir)) return ToGrpcStatus(exported.status());
    return ToGrpcStatus(absl::Status(
        exported.status().code(),
        absl::StrCat("the coordinator cannot stage the checkpoint under its --data_dir (",
                     staging_dir_, "): ", absl::StrReplaceAll(message, {{dir + "/", ""}}))));
  }
  if (!fd.valid()) return ToGrpcStatus(absl::InternalError("cannot reopen the exported file"));
  v1::CheckpointChunk chunk;
  chunk.set_step(exported->step());
  chunk.set_total_bytes(exported->bytes());
  // The caller is checked again at every chunk: a token revoked or expired mid-download
  // ends it (as it ends a watch).
  auto may_go_on = [&]() -> absl::Status {
    if (context->IsCancelled()) return absl::CancelledError("cancelled");
    return policy_.Check(*context, "DownloadCheckpoint").status();
  };
  auto send = [&](absl::string_view data) {
    chunk.set_data(data.data(), data.size());
    const bool written = writer->Write(chunk);
    chunk.Clear();
    return written;
  };
  return ToGrpcStatus(
      StreamFile(fd.get(), exported->weights_path(), exported->bytes(), 1 << 20, may_go_on, send));
}

grpc::Status JobServiceImpl::ClusterStatus(grpc::ServerContext* context,
                                           const v1::ClusterStatusRequest*,
                                           v1::ClusterStatusResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "ClusterStatus", &caller); !denied.ok())
    return denied;
  *reply = ClusterView();
  if (caller.has_value() && caller->role == security::Role::kUser) {
    // A user sees the cluster, not other users' jobs: their ids are left out.
    std::map<std::string, bool> mine;
    auto others = [&](const std::string& job_id) {
      if (job_id.empty()) return false;
      auto [it, added] = mine.emplace(job_id, false);
      if (added) {
        absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
        it->second = job.ok() && job->owner() == caller->name;
      }
      return !it->second;
    };
    for (v1::MemberInfo& w : *reply->mutable_workers()) {
      if (others(w.job_id())) w.clear_job_id();
    }
    for (v1::BlobMove& m : *reply->mutable_moves()) {
      if (others(m.key().job_id())) m.mutable_key()->clear_job_id();
    }
  }
  return grpc::Status::OK;
}

v1::ClusterStatusResponse JobServiceImpl::ClusterView() const {
  v1::ClusterStatusResponse reply;
  members_->ExpireLeases();
  for (v1::MemberInfo& m : members_->Members(v1::MEMBER_ROLE_STORE))
    *reply.add_stores() = std::move(m);
  for (v1::MemberInfo& m : members_->Members(v1::MEMBER_ROLE_WORKER))
    *reply.add_workers() = std::move(m);
  if (scheduler_ != nullptr) scheduler_->ReplicationStatus(&reply);
  return reply;
}

grpc::Status JobServiceImpl::ExpertHeat(grpc::ServerContext* context,
                                        const v1::ExpertHeatRequest* request,
                                        v1::ExpertHeatResponse* reply) {
  if (grpc::Status denied = AdmitForJob(*context, "ExpertHeat", request->job_id()); !denied.ok())
    return denied;
  return ToGrpcReply(HeatView(request->job_id(), request->layer()), reply);
}

absl::StatusOr<v1::ExpertHeatResponse> JobServiceImpl::HeatView(const std::string& job_id,
                                                                int layer) const {
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(job_id));
  absl::StatusOr<v1::ExpertHeatResponse> heat = heat_->Heat(job_id, layer);
  if (absl::IsNotFound(heat.status()) && IsFinal(job.state())) {  // no "yet" for an ended job
    return absl::NotFoundError(absl::StrCat("job ", job_id, " ended with no heat recorded"));
  }
  ASSIGN_OR_RETURN(v1::ExpertHeatResponse reply, std::move(heat));
  reply.set_placement_epoch(job.placement_epoch());
  if (scheduler_ == nullptr) return reply;
  absl::StatusOr<v1::PlacementTable> placement = scheduler_->GetPlacement(job_id);
  if (!placement.ok()) return reply;
  std::map<std::pair<int, int>, const v1::ExpertPlacement*> by_expert;
  for (const v1::ExpertPlacement& e : placement->experts()) {
    by_expert[{e.layer(), e.expert()}] = &e;
  }
  for (v1::ExpertHeatEntry& entry : *reply.mutable_experts()) {
    auto it = by_expert.find({entry.expert().layer(), entry.expert().expert()});
    if (it == by_expert.end()) continue;
    entry.set_compute_replicas(it->second->owners_size());
    entry.set_store_replicas(it->second->store_ids_size());
  }
  return reply;
}

}  // namespace pith::coordinator
