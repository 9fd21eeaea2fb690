// The body of every Pith server's main(): metrics, a gRPC server, a ready line, and a
// clean stop on SIGTERM/SIGINT. Each component passes in its services.
#ifndef PITH_COMMON_SERVER_PROCESS_H_
#define PITH_COMMON_SERVER_PROCESS_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "common/process.h"
#include "grpcpp/grpcpp.h"

namespace pith {

struct ServerProcessOptions {
  // Component name for logs and pith_build_info ("coordinator", "store").
  std::string component;
  // gRPC listen address ("host:port", port 0 = ephemeral).
  std::string listen_address;
  // Prometheus /metrics port; -1 disables the endpoint, 0 = ephemeral. It binds
  // metrics_host, or the host of listen_address when that is empty.
  int metrics_port = -1;
  std::string metrics_host;
  // Mutual TLS or plaintext (security/tls.h); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // gRPC services; not owned, must outlive the call.
  std::vector<grpc::Service*> services;
  // Pages served beside /metrics on its port (the coordinator's dashboard).
  std::map<std::string, HttpHandler> http_routes;
  // Called once both endpoints are up, with their bound ports.
  std::function<void(int grpc_port, int metrics_port)> on_ready;
  // Called at the shutdown signal, before the gRPC server stops taking calls (its running
  // calls get 5 s): what must not go on without them (the coordinator's lease checks).
  std::function<void()> on_stopping;
};

// Runs the server until `signals` reports SIGTERM or SIGINT (`signals` must have been
// constructed before any thread started). Returns an error when an endpoint cannot be
// bound; OK after a clean shutdown.
absl::Status RunServerProcess(const ServerProcessOptions& options, MetricsRegistry& metrics,
                              ShutdownSignals& signals);

}  // namespace pith

#endif  // PITH_COMMON_SERVER_PROCESS_H_
