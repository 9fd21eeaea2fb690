#include "server/store/store_server.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file.h"
#include "common/member_identity.h"
#include "common/status.h"
#include "common/ucx_auth.h"
#include "glog/logging.h"
#include "server/store/store_service.h"

namespace pith::store {

struct StoreServer::Probe {
  absl::Mutex mu;
  BlobStore* store ABSL_GUARDED_BY(mu) = nullptr;
};

void StoreServer::ExportDiskGauges(const std::string& data_dir, MetricsRegistry* metrics) {
  probe_ = std::make_shared<Probe>();
  {
    absl::MutexLock lock(&probe_->mu);
    probe_->store = store_.get();
  }
  metrics->OnScrape([metrics, data_dir, probe = probe_] {
    struct statvfs fs {};
    if (statvfs(data_dir.c_str(), &fs) == 0) {
      const double unit = static_cast<double>(fs.f_frsize);
      for (const auto& [name, help, value] :
           {std::tuple<const char*, const char*, double>{
                "pith_store_disk_free_bytes",
                "Bytes free to this process on the data dir's file system", unit * fs.f_bavail},
            {"pith_store_disk_capacity_bytes", "Size of the data dir's file system",
             unit * fs.f_blocks}}) {
        absl::StatusOr<prometheus::Gauge*> g = metrics->Gauge(name, help);
        if (g.ok()) (*g)->Set(value);
      }
    }
    absl::MutexLock lock(&probe->mu);
    if (probe->store == nullptr) return;
    absl::StatusOr<prometheus::Gauge*> healthy = metrics->Gauge(
        "pith_store_healthy", "1 while the durable tier works, 0 once it failed (disk errors)");
    if (healthy.ok()) (*healthy)->Set(probe->store->cold().Health().ok() ? 1 : 0);
  });
}

namespace {

// Creates --data_dir, readable by its owner only where this process may say so (it holds
// every job's weights and optimizer state); FAILED_PRECONDITION for a drained store's.
absl::Status PrepareDataDir(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("--data_dir is required");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create --data_dir ", dir, ": ", ec.message()));
  }
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, ec);
  if (ec) {  // another user's folder this one writes through its group: its owner decides
    LOG(WARNING) << "cannot restrict --data_dir " << dir << " to its owner (" << ec.message()
                 << "); every job's weights are as readable as the folder is";
  }
  if (absl::StatusOr<Buffer> why = ReadFile(DrainedMarker(dir)); why.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--data_dir ", dir, " holds a store that was drained and stopped (", DrainedMarker(dir),
        ": ",
        absl::StripAsciiWhitespace(
            absl::string_view(reinterpret_cast<const char*>(why->data()), why->size())),
        "); start a new store on an empty --data_dir, or remove that file to start this "
        "one again"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const StoreServerOptions& options,
                                                                MetricsRegistry* metrics) {
  RETURN_IF_ERROR(PrepareDataDir(options.data_dir));
  std::error_code ec;
  if (!options.export_root.empty()) std::filesystem::create_directories(options.export_root, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create --export_root ", options.export_root, ": ", ec.message()));
  }
  std::unique_ptr<StoreServer> s(new StoreServer());
  s->data_dir_ = options.data_dir;
  ASSIGN_OR_RETURN(s->worker_, ucx::Worker::Create());
  // The RAM tier lives in UCX-registered memory: blobs leave from it and arrive in it
  // with no copy on this side.
  ASSIGN_OR_RETURN(s->arena_, s->worker_->Allocate(options.ram_bytes));
  ASSIGN_OR_RETURN(
      std::unique_ptr<ColdTier> cold,
      OpenRocksColdTier(options.data_dir, {.sync_interval = options.sync_interval,
                                           .disk_reserve_bytes = options.disk_reserve_bytes}));
  BlobStoreOptions store_options;
  store_options.ram_bytes = options.ram_bytes;
  store_options.max_blob_bytes = options.max_blob_bytes;
  store_options.admission_window = options.admission_window;
  ASSIGN_OR_RETURN(s->store_,
                   BlobStore::Open(store_options, std::move(cold), s->arena_->data(), metrics));
  ASSIGN_OR_RETURN(s->data_plane_,
                   DataPlane::Create(s->worker_.get(), s->store_.get(), s->arena_.get(), metrics));
  if (metrics != nullptr) s->ExportDiskGauges(options.data_dir, metrics);
  // A cluster member with TLS serves its data plane to holders of the cluster's key only,
  // from the start: nothing is answered until registration brings the key.
  if (options.security.tls() && !options.coordinator.empty()) ucx::RequireDataPlaneAuth();
  RETURN_IF_ERROR(s->worker_->Start());
  s->service_ = std::make_unique<StoreServiceImpl>(s->store_.get(), s->worker_->address(),
                                                   options.export_root, options.security.tls());
  RETURN_IF_ERROR(options.security.CheckListen(options.listen_address));
  ASSIGN_OR_RETURN(s->grpc_,
                   GrpcServer::Start({.listen_address = options.listen_address,
                                      .services = {s->service_.get()},
                                      .max_message_bytes = options.max_message_bytes,
                                      .credentials = options.security.ServerCredentials()}));
  if (!options.coordinator.empty()) {
    // Advertise an address others can reach: the listen host, or this host's name when
    // listening on every interface.
    std::string host = options.listen_address.substr(0, options.listen_address.rfind(':'));
    if (host == "0.0.0.0" || host == "[::]" || host.empty()) {
      char name[256] = {};
      gethostname(name, sizeof(name) - 1);
      host = name;
    }
    // The coordinator dials this host: a certificate that does not name it would fail
    // every call there, far from here.
    RETURN_IF_ERROR(options.security.CheckNames(host));
    v1::MemberInfo self;
    self.set_role(v1::MEMBER_ROLE_STORE);
    ASSIGN_OR_RETURN(*self.mutable_identity(), LoadOrCreateIdentity(options.data_dir));
    self.set_grpc_address(absl::StrCat(host, ":", s->grpc_->port()));
    self.set_ucx_address(s->worker_->address());
    self.set_capacity_bytes(options.ram_bytes);
    self.set_max_blob_bytes(
        std::min(options.max_blob_bytes, BlobStore::LargestBlock(store_options)));
    if (options.metrics_port >= 0)
      self.set_metrics_address(absl::StrCat(host, ":", options.metrics_port));
    BlobStore* store = s->store_.get();
    ASSIGN_OR_RETURN(s->agent_, MemberAgent::Start(
                                    options.coordinator, options.security, std::move(self),
                                    [store, dir = options.data_dir,
                                     reserve = options.disk_reserve_bytes](v1::MemberInfo* status) {
                                      const v1::StoreStats st = store->Stats();
                                      status->set_ram_bytes(st.ram_bytes());
                                      status->set_rocksdb_bytes(st.rocksdb_bytes());
                                      if (absl::StatusOr<uint64_t> free = FreeBytes(dir);
                                          free.ok()) {
                                        status->set_disk_free_bytes(*free);
                                        status->set_disk_reserve_bytes(reserve);
                                      }
                                      const absl::Status health = store->cold().Health();
                                      status->set_health(health.ok() ? "" : health.ToString());
                                    },
                                    [dir = options.data_dir](const std::string& cluster_id) {
                                      return KeepClusterId(dir, cluster_id);
                                    }));
    LOG(INFO) << "registered with the coordinator at " << options.coordinator << " as "
              << s->agent_->member_id();
  }
  const v1::StoreStats stats = s->store_->Stats();
  LOG(INFO) << "store open: " << stats.blobs() << " committed blobs, " << stats.rocksdb_bytes()
            << " bytes in RocksDB at " << options.data_dir << ", RAM tier " << options.ram_bytes
            << " bytes";
  return s;
}

StoreServer::~StoreServer() {
  // Each phase is timed: a stop that takes long says where (a clean stop ends with the
  // cold tier's last sync point, which waits for the disk).
  absl::Time mark = absl::Now();
  std::string phases;
  auto lap = [&](const char* phase) {
    const absl::Time now = absl::Now();
    const std::string took = absl::FormatDuration(absl::Trunc(now - mark, absl::Milliseconds(1)));
    // A slow phase is logged as it ends: were a later one to hang, this one is on record.
    LOG_IF(INFO, now - mark > absl::Seconds(1))
        << "stopping the store: " << phase << " took " << took;
    absl::StrAppend(&phases, phases.empty() ? "" : ", ", phase, " ", took);
    mark = now;
  };
  const absl::Time start = mark;
  // Leave the cluster first. A drained store marks its folder: its data is no longer the
  // cluster's, and `pith up` (or anyone) must not start it again by mistake.
  if (agent_ != nullptr) {
    const std::string id = agent_->member_id();
    if (agent_->Leave()) {
      const std::string text =
          absl::StrCat(id, " was drained, then stopped at ", absl::FormatTime(absl::Now()), "\n");
      const absl::Status marked = WriteFileAtomically(DrainedMarker(data_dir_), [&](int fd) {
        return WriteAll(fd, {reinterpret_cast<const uint8_t*>(text.data()), text.size()},
                        DrainedMarker(data_dir_));
      });
      LOG_IF(WARNING, !marked.ok()) << "drained store: " << marked;
    }
    agent_.reset();
  }
  if (probe_) {
    absl::MutexLock lock(&probe_->mu);
    probe_->store = nullptr;
  }
  lap("deregister");
  if (grpc_) grpc_->Shutdown();
  lap("gRPC");
  // No more data-plane traffic: waiting puts are dropped while their endpoints are open,
  // then in-flight sends are cancelled and release their pins.
  if (data_plane_) data_plane_->Shutdown();
  if (worker_) worker_->Stop();
  lap("data plane");
  grpc_.reset();
  service_.reset();
  data_plane_.reset();
  store_.reset();  // returns every RAM block; the cold tier's last sync point
  lap("store close");
  arena_.reset();  // unregisters the arena while the UCX context lives
  worker_.reset();
  lap("UCX");
  LOG(INFO) << "store stopped in "
            << absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))) << " ("
            << phases << ")";
}

}  // namespace pith::store
