// pith-store: the expert store process (DESIGN §1, §4).
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/server_process.h"
#include "glog/logging.h"
#include "pith/v1/store.grpc.pb.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7100", "gRPC listen address (host:port)");
ABSL_FLAG(int, metrics_port, 9101, "Prometheus /metrics port; -1 disables it, 0 picks one");

int main(int argc, char** argv) {
  pith::ShutdownSignals signals;
  pith::InitProcess(argc, argv,
                    "holds expert weights and optimizer state for Pith workers.\n"
                    "Usage: pith-store --listen=HOST:PORT --metrics_port=PORT");
  // NOTE: the services are registered with every RPC answering UNIMPLEMENTED until the
  // store issue implements them; the process, its ports and its metrics are real.
  pith::v1::StoreService::Service store_service;
  pith::MetricsRegistry metrics;
  absl::Status status = pith::RunServerProcess({.component = "store",
                                                .listen_address = absl::GetFlag(FLAGS_listen),
                                                .metrics_port = absl::GetFlag(FLAGS_metrics_port),
                                                .services = {&store_service}},
                                               metrics, signals);
  if (!status.ok()) {
    LOG(ERROR) << "pith-store: " << status.message();
    return EXIT_FAILURE;
  }
  return EXIT_SUCCESS;
}
