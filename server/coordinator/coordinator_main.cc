// pith-coordinator: membership, placement, heat and the job API (DESIGN §1, §5).
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/server_process.h"
#include "glog/logging.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "pith/v1/job.grpc.pb.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7000", "gRPC listen address (host:port)");
ABSL_FLAG(int, metrics_port, 9100, "Prometheus /metrics port; -1 disables it, 0 picks one");

int main(int argc, char** argv) {
  pith::ShutdownSignals signals;
  pith::InitProcess(argc, argv,
                    "the brain of a Pith cluster.\n"
                    "Usage: pith-coordinator --listen=HOST:PORT --metrics_port=PORT");
  // NOTE: the services are registered with every RPC answering UNIMPLEMENTED until the
  // coordinator issue implements them; the process, its ports and its metrics are real.
  pith::v1::JobService::Service job_service;
  pith::v1::CoordinatorService::Service coordinator_service;
  pith::MetricsRegistry metrics;
  absl::Status status = pith::RunServerProcess({.component = "coordinator",
                                                .listen_address = absl::GetFlag(FLAGS_listen),
                                                .metrics_port = absl::GetFlag(FLAGS_metrics_port),
                                                .services = {&job_service, &coordinator_service}},
                                               metrics, signals);
  if (!status.ok()) {
    LOG(ERROR) << "pith-coordinator: " << status.message();
    return EXIT_FAILURE;
  }
  return EXIT_SUCCESS;
}
