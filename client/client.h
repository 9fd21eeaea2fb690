// pith::Client: the C++ client of the job API (proto/pith/v1/job.proto). Every call has a
// deadline; calls that find the coordinator UNAVAILABLE are retried a few times with
// backoff; errors are absl::Status with the coordinator's message (a bad spec field is
// named, an unknown job says so).
//
// Thread safety: all methods are thread-safe (gRPC stubs are).
#ifndef PITH_CLIENT_CLIENT_H_
#define PITH_CLIENT_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "pith/v1/job.grpc.pb.h"
#include "security/tls.h"

namespace pith {

class Client {
 public:
  // A client of the coordinator at `address`, over mutual TLS with the certificate of
  // `security` (a user's or an admin's: security/tls.h), or plaintext on loopback.
  // UNAVAILABLE, naming the address, when it cannot be reached within `timeout`.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, const security::TransportSecurity& security,
      absl::Duration timeout = absl::Seconds(5));

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec);
  absl::StatusOr<v1::Job> Get(const std::string& job_id);
  // Newest first; limit 0: all.
  absl::StatusOr<std::vector<v1::Job>> List(int limit = 0);
  // Calls `on_event` with every event of the job until it ends or `on_event` returns false.
  // A dropped stream (a coordinator restart) is taken up again from the job's current
  // state (steps committed meanwhile are not replayed) for up to kWatchResume after the
  // last event; UNAVAILABLE past that, or after 4 tries when no event came at all.
  absl::Status Watch(const std::string& job_id,
                     const std::function<bool(const v1::JobEvent&)>& on_event);
  static constexpr absl::Duration kWatchResume = absl::Seconds(60);
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason = "");
  // Forgets an ended job (its record, heat and stored weights); returns its last record.
  absl::StatusOr<v1::Job> Remove(const std::string& job_id);
  // Writes the job's last committed weights under `output_dir` on the coordinator's host:
  // a path under its --export_root (relative to it, or absolute under it); without one,
  // FAILED_PRECONDITION (DownloadCheckpoint needs none).
  absl::StatusOr<v1::CheckpointJobResponse> Checkpoint(const std::string& job_id,
                                                       const std::string& output_dir);
  // Streams the job's last committed weights from the coordinator into `path` here
  // (written beside it, synced, then renamed onto it). Returns the step and bytes. An
  // existing `path` is replaced only with `replace`; otherwise ALREADY_EXISTS, before the
  // download and again at the rename (a file that appeared meanwhile is kept).
  absl::StatusOr<v1::CheckpointJobResponse> DownloadCheckpoint(const std::string& job_id,
                                                               const std::string& path,
                                                               bool replace = false);
  // The file a download into `path` writes first: removed on any error the download
  // returns; a program that a signal ends mid-download removes it itself.
  static std::string PartialPath(const std::string& path);
  absl::StatusOr<v1::ClusterStatusResponse> ClusterStatus();
  absl::StatusOr<v1::ExpertHeatResponse> ExpertHeat(const std::string& job_id, int layer = -1);
  // Starts draining a store (ClusterStatus shows the progress and when it can be stopped).
  absl::StatusOr<v1::DrainStoreResponse> DrainStore(const std::string& store_id);

  const std::string& address() const { return address_; }

 private:
  Client(std::string address, std::unique_ptr<v1::JobService::Stub> stub,
         std::unique_ptr<v1::CoordinatorService::Stub> coordinator)
      : address_(std::move(address)),
        stub_(std::move(stub)),
        coordinator_(std::move(coordinator)) {}
  // Runs `call` with a fresh context and `deadline`, retrying on UNAVAILABLE.
  absl::Status Call(absl::Duration deadline,
                    const std::function<grpc::Status(grpc::ClientContext*)>& call);
  // An RPC's status as this client says it: gRPC's UNIMPLEMENTED without text (an
  // address that serves gRPC but not this call, such as a store's port) names the address.
  absl::Status Said(const grpc::Status& status) const;

  const std::string address_;
  std::unique_ptr<v1::JobService::Stub> stub_;
  std::unique_ptr<v1::CoordinatorService::Stub> coordinator_;
};

}  // namespace pith

#endif  // PITH_CLIENT_CLIENT_H_
