#include "common/server_process.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pith {

absl::Status RunServerProcess(const ServerProcessOptions& options, MetricsRegistry& metrics,
                              ShutdownSignals& signals) {
  RETURN_IF_ERROR(RegisterProcessMetrics(metrics, options.component));

  std::unique_ptr<MetricsExposer> exposer;
  if (options.metrics_port >= 0) {
    ASSIGN_OR_RETURN(exposer, MetricsExposer::Start(
                                  MetricsBindAddress(options.metrics_host, options.listen_address,
                                                     options.metrics_port),
                                  metrics, options.http_routes));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> server,
                   GrpcServer::Start({.listen_address = options.listen_address,
                                      .services = options.services,
                                      .credentials = options.credentials}));
  const int metrics_port = exposer ? exposer->port() : -1;
  LOG(INFO) << "pith-" << options.component << " ready: grpc_port=" << server->port()
            << " metrics_port=" << metrics_port;
  if (options.on_ready) options.on_ready(server->port(), metrics_port);

  const int sig = signals.Wait();
  LOG(INFO) << "pith-" << options.component << " stopping on signal " << sig;
  if (options.on_stopping) options.on_stopping();
  server->Shutdown();
  return absl::OkStatus();
}

}  // namespace pith
