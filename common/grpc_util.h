// gRPC glue: a server with a bound port that shuts down on destruction (the Status
// conversion at the RPC boundary is in grpc_status.h, included here).
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
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"

namespace pith {

struct GrpcServerOptions {
  // "host:port"; port 0 picks an ephemeral port.
  std::string listen_address;
  // Services to serve (at least one); not owned, must outlive the server.
  std::vector<grpc::Service*> services;
  int max_message_bytes = kDefaultMaxMessageBytes;
  // Mutual TLS or plaintext (security/tls.h); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
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
