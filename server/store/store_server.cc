#include "server/store/store_server.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/store/store_service.h"

namespace pith::store {

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const StoreServerOptions& options,
                                                                MetricsRegistry* metrics) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data_dir is required");
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create --data_dir ", options.data_dir, ": ", ec.message()));
  }
  std::unique_ptr<StoreServer> s(new StoreServer());
  ASSIGN_OR_RETURN(s->worker_, ucx::Worker::Create());
  // The RAM tier lives in UCX-registered memory: blobs leave from it and arrive in it
  // with no copy on this side.
  ASSIGN_OR_RETURN(s->arena_, s->worker_->Allocate(options.ram_bytes));
  ASSIGN_OR_RETURN(std::unique_ptr<ColdTier> cold, OpenRocksColdTier(options.data_dir));
  BlobStoreOptions store_options;
  store_options.ram_bytes = options.ram_bytes;
  store_options.max_blob_bytes = options.max_blob_bytes;
  store_options.admission_window = options.admission_window;
  ASSIGN_OR_RETURN(s->store_,
                   BlobStore::Open(store_options, std::move(cold), s->arena_->data(), metrics));
  ASSIGN_OR_RETURN(s->data_plane_,
                   DataPlane::Create(s->worker_.get(), s->store_.get(), s->arena_.get(), metrics));
  RETURN_IF_ERROR(s->worker_->Start());
  s->service_ = std::make_unique<StoreServiceImpl>(s->store_.get(), s->worker_->address());
  ASSIGN_OR_RETURN(s->grpc_, GrpcServer::Start({.listen_address = options.listen_address,
                                                .services = {s->service_.get()},
                                                .max_message_bytes = options.max_message_bytes}));
  const v1::StoreStats stats = s->store_->Stats();
  LOG(INFO) << "store open: " << stats.blobs() << " committed blobs, " << stats.rocksdb_bytes()
            << " bytes in RocksDB at " << options.data_dir << ", RAM tier " << options.ram_bytes
            << " bytes";
  return s;
}

StoreServer::~StoreServer() {
  if (grpc_) grpc_->Shutdown();
  // No more data-plane traffic: in-flight sends are cancelled and release their pins.
  if (worker_) worker_->Stop();
  grpc_.reset();
  service_.reset();
  data_plane_.reset();
  store_.reset();  // returns every RAM block
  arena_.reset();  // unregisters the arena while the UCX context lives
  worker_.reset();
}

}  // namespace pith::store
