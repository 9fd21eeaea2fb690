#include "client/client.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "common/grpc_util.h"
#include "common/job_state.h"
#include "common/rename_onto.h"
#include "common/status.h"

namespace pith {

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        const security::TransportSecurity& security,
                                                        absl::Duration timeout) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Dial(address, security, timeout));
  return std::unique_ptr<Client>(new Client(address, v1::JobService::NewStub(channel),
                                            v1::CoordinatorService::NewStub(channel)));
}

absl::Status Client::Said(const grpc::Status& status) const {
  absl::Status s = FromGrpcStatus(status);
  // gRPC's own answer for a method the server does not have has no text; the
  // coordinator's UNIMPLEMENTED answers say what they refuse.
  if (!absl::IsUnimplemented(s) || !s.message().empty()) return s;
  return absl::UnimplementedError(absl::StrCat(
      address_,
      " does not serve this call of the coordinator's API (a store's or a worker's port, or a "
      "coordinator older than this pith?)"));
}

absl::Status Client::Call(absl::Duration deadline,
                          const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  absl::Status status;
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(200 << attempt));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    status = Said(call(&ctx));
    if (!absl::IsUnavailable(status)) return status;
  }
  return absl::UnavailableError(
      absl::StrCat("coordinator ", address_, " unavailable: ", status.message()));
}

absl::StatusOr<v1::Job> Client::Submit(const v1::JobSpec& spec) {
  v1::SubmitJobRequest req;
  *req.mutable_spec() = spec;
  v1::SubmitJobResponse resp;
  RETURN_IF_ERROR(Call(absl::Seconds(10),
                       [&](grpc::ClientContext* c) { return stub_->SubmitJob(c, req, &resp); }));
  return resp.job();
}

absl::StatusOr<v1::Job> Client::Get(const std::string& job_id) {
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  v1::Job job;
  RETURN_IF_ERROR(
      Call(absl::Seconds(10), [&](grpc::ClientContext* c) { return stub_->GetJob(c, req, &job); }));
  return job;
}

absl::StatusOr<std::vector<v1::Job>> Client::List(int limit) {
  v1::ListJobsRequest req;
  req.set_limit(limit);
  v1::ListJobsResponse resp;
  RETURN_IF_ERROR(Call(absl::Seconds(10),
                       [&](grpc::ClientContext* c) { return stub_->ListJobs(c, req, &resp); }));
  return std::vector<v1::Job>(resp.jobs().begin(), resp.jobs().end());
}

absl::Status Client::Watch(const std::string& job_id,
                           const std::function<bool(const v1::JobEvent&)>& on_event) {
  v1::WatchJobRequest req;
  req.set_job_id(job_id);
  // The stream is long; a dropped connection is taken up again from the job's state.
  absl::Time heard = absl::InfinitePast();  // the last event; none yet: 4 tries in all
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    auto stream = stub_->WatchJob(&ctx, req);
    v1::JobEvent event;
    while (stream->Read(&event)) {
      heard = absl::Now();
      if (!on_event(event)) {
        ctx.TryCancel();
        stream->Finish();
        return absl::OkStatus();
      }
      if (IsFinal(event.state())) {
        stream->Finish();
        return absl::OkStatus();
      }
    }
    absl::Status s = Said(stream->Finish());
    // A coordinator going down ends the stream UNAVAILABLE or, when its server cancels the
    // call on the way out, CANCELLED (this side cancels only once on_event said stop).
    if (!absl::IsUnavailable(s) && !absl::IsCancelled(s)) return s;
    if (heard == absl::InfinitePast() ? attempt >= 4 : absl::Now() - heard > kWatchResume) {
      return absl::UnavailableError(
          absl::StrCat("coordinator ", address_, " unavailable: ", s.message()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

absl::StatusOr<v1::Job> Client::Cancel(const std::string& job_id, const std::string& reason) {
  v1::CancelJobRequest req;
  req.set_job_id(job_id);
  req.set_reason(reason);
  v1::Job job;
  RETURN_IF_ERROR(Call(absl::Seconds(10),
                       [&](grpc::ClientContext* c) { return stub_->CancelJob(c, req, &job); }));
  return job;
}

absl::StatusOr<v1::Job> Client::Remove(const std::string& job_id) {
  v1::RemoveJobRequest req;
  req.set_job_id(job_id);
  v1::Job job;
  RETURN_IF_ERROR(Call(absl::Seconds(10),
                       [&](grpc::ClientContext* c) { return stub_->RemoveJob(c, req, &job); }));
  return job;
}

absl::StatusOr<v1::CheckpointJobResponse> Client::Checkpoint(const std::string& job_id,
                                                             const std::string& output_dir) {
  v1::CheckpointJobRequest req;
  req.set_job_id(job_id);
  req.set_output_dir(output_dir);
  v1::CheckpointJobResponse resp;
  RETURN_IF_ERROR(Call(absl::Minutes(5), [&](grpc::ClientContext* c) {
    return stub_->CheckpointJob(c, req, &resp);
  }));
  return resp;
}

namespace {

// Writes all of `data` to `fd`.
// 0, or the errno of the write that failed (ENOSPC for a zero-byte write).
int WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return ENOSPC;
    done += static_cast<size_t>(n);
  }
  return 0;
}

// A download's file could not be written: RESOURCE_EXHAUSTED for a full disk or quota,
// INTERNAL otherwise.
absl::Status CannotWrite(const std::string& path, uint64_t bytes, int error) {
  const std::string message =
      absl::StrCat("cannot write ", path, " (", bytes, " bytes): ", std::strerror(error));
  return error == ENOSPC || error == EDQUOT || error == EFBIG
             ? absl::ResourceExhaustedError(message)
             : absl::InternalError(message);
}

absl::Status Exists(const std::string& path) {
  return absl::AlreadyExistsError(absl::StrCat(path, " already exists and is not replaced"));
}

}  // namespace

std::string Client::PartialPath(const std::string& path) {
  return absl::StrCat(path, ".partial-", ::getpid());
}

absl::StatusOr<v1::CheckpointJobResponse> Client::DownloadCheckpoint(const std::string& job_id,
                                                                     const std::string& path,
                                                                     bool replace) {
  struct stat st;
  if (!replace && ::lstat(path.c_str(), &st) == 0) return Exists(path);
  if (!RegularOrMissing(path.c_str())) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a regular file (a directory, a link or a device): not replaced"));
  }
  const std::string partial = PartialPath(path);
  const int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {  // named as the caller named it: the partial file is ours
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  v1::DownloadCheckpointRequest req;
  req.set_job_id(job_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
  auto stream = stub_->DownloadCheckpoint(&ctx, req);
  v1::CheckpointChunk chunk;
  v1::CheckpointJobResponse out;
  uint64_t total = 0, got = 0;
  bool first = true;
  int write_error = 0;
  while (write_error == 0 && stream->Read(&chunk)) {
    if (first) {
      out.set_step(chunk.step());
      total = chunk.total_bytes();
      first = false;
    }
    write_error = WriteAll(fd, chunk.data());
    got += chunk.data().size();
  }
  if (write_error != 0) ctx.TryCancel();  // the stream then ends CANCELLED: ours is the error
  absl::Status s = Said(stream->Finish());
  if (write_error != 0) s = CannotWrite(path, total, write_error);
  if (s.ok() && (first || got != total)) {
    s = absl::DataLossError(
        absl::StrCat("the checkpoint stream ended after ", got, " of ", total, " bytes"));
  }
  if (s.ok() && ::fsync(fd) != 0) s = CannotWrite(path, total, errno);
  if (::close(fd) != 0 && s.ok()) s = CannotWrite(path, total, errno);
  if (s.ok() && RenameOnto(partial.c_str(), path.c_str(), replace) != 0) {
    s = errno == EEXIST
            ? Exists(path)
            : absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  if (!s.ok()) {
    ::unlink(partial.c_str());
    return s;
  }
  out.set_weights_path(path);
  out.set_bytes(got);
  return out;
}

absl::StatusOr<v1::ClusterStatusResponse> Client::ClusterStatus() {
  v1::ClusterStatusResponse resp;
  RETURN_IF_ERROR(Call(absl::Seconds(10), [&](grpc::ClientContext* c) {
    return stub_->ClusterStatus(c, v1::ClusterStatusRequest(), &resp);
  }));
  return resp;
}

absl::StatusOr<v1::DrainStoreResponse> Client::DrainStore(const std::string& store_id) {
  v1::DrainStoreRequest req;
  req.set_store_id(store_id);
  v1::DrainStoreResponse resp;
  // Sizing the drain lists the store's groups: allow it time.
  RETURN_IF_ERROR(Call(absl::Seconds(60), [&](grpc::ClientContext* c) {
    return coordinator_->DrainStore(c, req, &resp);
  }));
  return resp;
}

absl::StatusOr<v1::ExpertHeatResponse> Client::ExpertHeat(const std::string& job_id, int layer) {
  v1::ExpertHeatRequest req;
  req.set_job_id(job_id);
  req.set_layer(layer);
  v1::ExpertHeatResponse resp;
  RETURN_IF_ERROR(Call(absl::Seconds(10),
                       [&](grpc::ClientContext* c) { return stub_->ExpertHeat(c, req, &resp); }));
  return resp;
}

}  // namespace pith
