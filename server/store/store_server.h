// StoreServer: one pith-store — the BlobStore over RocksDB, its RAM arena in UCX-registered
// memory, the UCX data plane and the gRPC StoreService — started and stopped as a unit, so
// tests run real stores in-process on ephemeral ports and pith-store's main stays thin.
//
// Thread safety: Start/destruction from one thread; the accessors are thread-safe.
#ifndef PITH_SERVER_STORE_STORE_SERVER_H_
#define PITH_SERVER_STORE_STORE_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/grpc_util.h"
#include "common/metrics.h"
#include "common/ucx.h"
#include "security/tls.h"
#include "server/coordinator/member_agent.h"
#include "server/store/blob_store.h"
#include "server/store/data_plane.h"

namespace pith::store {

struct StoreServerOptions {
  std::string listen_address = "127.0.0.1:0";  // gRPC
  std::string data_dir;                        // blob log + RocksDB index (created if missing)
  uint64_t ram_bytes = 1ull << 30;
  uint64_t max_blob_bytes = 64ull << 20;
  uint64_t admission_window = 4096;                     // see BlobStoreOptions
  absl::Duration sync_interval = absl::ZeroDuration();  // see RocksColdTierOptions
  uint64_t disk_reserve_bytes = 64ull << 20;            // see RocksColdTierOptions
  std::string export_root;  // Checkpoint writes only under it (empty: exports are off)
  int max_message_bytes = kDefaultMaxMessageBytes;
  std::string coordinator;  // optional: register with this coordinator and heartbeat
  int metrics_port = -1;    // advertised to the coordinator
  // Mutual TLS (a member's certificate) or plaintext on loopback, for the gRPC server and
  // the channel to the coordinator.
  security::TransportSecurity security;
};

class StoreServiceImpl;

class StoreServer {
 public:
  // FAILED_PRECONDITION on a --data_dir whose store was drained and stopped (its
  // DrainedMarker file is there: the stop of a drained store writes it).
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(const StoreServerOptions& options,
                                                            MetricsRegistry* metrics);
  // Stops gRPC, then the data plane, then closes the store.
  ~StoreServer();

  int grpc_port() const { return grpc_->port(); }
  const std::string& ucx_address() const { return worker_->address(); }
  BlobStore& store() { return *store_; }

 private:
  StoreServer() = default;

  // Destruction order matters and is spelled out in ~StoreServer.
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<ucx::MemoryRegion> arena_;
  std::unique_ptr<BlobStore> store_;
  std::unique_ptr<DataPlane> data_plane_;
  std::unique_ptr<StoreServiceImpl> service_;
  std::unique_ptr<GrpcServer> grpc_;
  std::unique_ptr<MemberAgent> agent_;  // when --coordinator is given
  std::string data_dir_;
  // What the metrics scrape hook reads; the hook outlives the server, so the store is
  // unset (under the probe's lock) before it closes.
  struct Probe;
  std::shared_ptr<Probe> probe_;

  void ExportDiskGauges(const std::string& data_dir, MetricsRegistry* metrics);
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_STORE_SERVER_H_
