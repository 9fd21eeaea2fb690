// gRPC glue: Status conversion at the RPC boundary, and a server with a bound port that
// shuts down on destruction.
//
// Thread safety: a GrpcServer is started, shut down and destroyed by its owner's thread;
// the services it serves run on gRPC's threads. Shutdown is idempotent.
#ifndef PITH_COMMON_GRPC_UTIL_H_
#define PITH_COMMON_GRPC_UTIL_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace pith {

// absl::Status <-> grpc::Status, keeping code and message. Only RPC adapters call these.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// A handler's answer: `result` moved into `*reply`, or its error.
template <typename T>
grpc::Status ToGrpcReply(absl::StatusOr<T> result, T* reply) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *reply = *std::move(result);
  return grpc::Status::OK;
}

// Message size limit of Pith's control plane. Bulk tensors travel over UCX, not gRPC.
inline constexpr int kDefaultMaxMessageBytes = 64 << 20;

struct GrpcServerOptions {
  // "host:port"; port 0 picks an ephemeral port.
  std::string listen_address;
  // Services to serve (at least one); not owned, must outlive the server.
  std::vector<grpc::Service*> services;
  int max_message_bytes = kDefaultMaxMessageBytes;
};

class GrpcServer {
 public:
  // Builds and starts the server with the standard gRPC health service enabled.
  // UNAVAILABLE when the address cannot be bound, INVALID_ARGUMENT without a service.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options);
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // The bound port.
  int port() const { return port_; }
  // Stops accepting calls and cancels those still running after `grace`.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

 private:
  GrpcServer(std::unique_ptr<grpc::Server> server, int port);

  std::unique_ptr<grpc::Server> server_;
  int port_;
};

}  // namespace pith

#endif  // PITH_COMMON_GRPC_UTIL_H_
