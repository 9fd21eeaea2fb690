// pith-store: the expert store process (DESIGN §1, §4).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/server_process.h"
#include "common/status.h"
#include "common/ucx.h"
#include "glog/logging.h"
#include "security/flags.h"
#include "server/store/store_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7100", "gRPC listen address (host:port)");
ABSL_FLAG(int, metrics_port, 9101, "Prometheus /metrics port; -1 disables it, 0 picks one");
ABSL_FLAG(std::string, metrics_listen, "",
          "Host (interface address) /metrics binds; default: the host of --listen");
ABSL_FLAG(std::string, ucx_net_devices, "auto",
          "Network devices UCX may use: auto (those of --listen's address, plus RDMA ports; "
          "every device for 0.0.0.0), all, or a UCX_NET_DEVICES list");
ABSL_FLAG(std::string, data_dir, "",
          "Directory of the durable tier: blob log + RocksDB index (required)");
ABSL_FLAG(uint64_t, ram_bytes, 1ull << 30, "RAM-tier budget in bytes (UCX-registered memory)");
ABSL_FLAG(uint64_t, max_blob_bytes, 64ull << 20, "Largest blob accepted, in bytes");
ABSL_FLAG(uint64_t, admission_window, 4096,
          "A cold blob is promoted into RAM on its second read among the last N cold reads, "
          "when it fits in free RAM or was read more recently than the blob it would evict; "
          "0 promotes on every read");
ABSL_FLAG(int, max_message_bytes, 64 << 20, "Largest gRPC message, in bytes");
ABSL_FLAG(int, sync_interval_ms, 0,
          "0 (the default): a commit returns once the step is on disk (one fdatasync of the "
          "step's bytes per step), so an acknowledged step survives a power loss. N > 0 trades "
          "that for speed: a committed step survives kill -9 of any process at once and is on "
          "disk within N ms (one background sync for every step in the interval; a step "
          "replaced before then never costs a disk write); a power loss within N ms of a "
          "commit makes this store refuse to start, and its groups are copied back from "
          "their replicas");
ABSL_FLAG(uint64_t, disk_reserve_bytes, 64ull << 20,
          "Free bytes kept on the data disk (4 MiB at least): the store does not start with "
          "less, and refuses a put that would leave less (RESOURCE_EXHAUSTED), so its index "
          "stays writable");
ABSL_FLAG(std::string, export_root, "",
          "Directory under which Checkpoint RPCs may write (RocksDB checkpoints, safetensors "
          "exports); never over a file, never through '..' or symlinks. Empty: exports are off");
ABSL_FLAG(std::string, coordinator, "",
          "Coordinator address (host:port): register there and keep the lease alive");

namespace {

absl::Status Run(pith::ShutdownSignals& signals) {
  pith::MetricsRegistry metrics;
  RETURN_IF_ERROR(pith::RegisterProcessMetrics(metrics, "store"));
  std::unique_ptr<pith::MetricsExposer> exposer;
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    ASSIGN_OR_RETURN(exposer, pith::MetricsExposer::Start(
                                  pith::MetricsBindAddress(absl::GetFlag(FLAGS_metrics_listen),
                                                           absl::GetFlag(FLAGS_listen),
                                                           absl::GetFlag(FLAGS_metrics_port)),
                                  metrics));
  }
  pith::store::StoreServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.ram_bytes = absl::GetFlag(FLAGS_ram_bytes);
  options.max_blob_bytes = absl::GetFlag(FLAGS_max_blob_bytes);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.admission_window = absl::GetFlag(FLAGS_admission_window);
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (absl::GetFlag(FLAGS_sync_interval_ms) < 0) {
    return absl::InvalidArgumentError("--sync_interval_ms must be >= 0");
  }
  options.sync_interval = absl::Milliseconds(absl::GetFlag(FLAGS_sync_interval_ms));
  options.disk_reserve_bytes = absl::GetFlag(FLAGS_disk_reserve_bytes);
  RETURN_IF_ERROR(pith::CheckDiskReserve(options.disk_reserve_bytes));
  options.export_root = absl::GetFlag(FLAGS_export_root);
  options.metrics_port = exposer ? exposer->port() : -1;
  ASSIGN_OR_RETURN(options.security, pith::security::TransportSecurityFromFlags(
                                         "pith-store", pith::security::Role::kMember));
  if (options.security.tls() && options.coordinator.empty()) {
    LOG(WARNING) << "no --coordinator: gRPC runs mutual TLS, but the UCX data plane has no "
                    "cluster key and answers any peer (DESIGN §8)";
  }
  ASSIGN_OR_RETURN(auto server, pith::store::StoreServer::Start(options, &metrics));
  LOG(INFO) << "pith-store ready: grpc_port=" << server->grpc_port()
            << " metrics_port=" << (exposer ? exposer->port() : -1);
  const int sig = signals.Wait();
  LOG(INFO) << "pith-store stopping on signal " << sig;
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  pith::ShutdownSignals signals;
  pith::InitProcess(argc, argv,
                    "holds expert weights and optimizer state for Pith workers.\n"
                    "Usage: pith-store --data_dir=DIR [--coordinator=HOST:PORT] "
                    "(--tls_dir=DIR | --insecure) [--listen=HOST:PORT] [--ram_bytes=N] "
                    "[--metrics_port=PORT]");
  pith::ucx::RestrictUcxDevices(absl::GetFlag(FLAGS_listen), absl::GetFlag(FLAGS_ucx_net_devices));
  return pith::ExitStatus("pith-store", Run(signals));
}
