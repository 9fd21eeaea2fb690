// The store's UCX data plane: serves batched fetches straight from the RAM tier
// (registered memory; rendezvous sends, no copy) and receives new versions straight into
// RAM-tier blocks. Headers are the UcxGetRequest/UcxPutRequest/UcxBlobReply protos.
//
// Thread safety: construction and destruction from the owner's thread; everything else
// runs on the UCX progress thread.
#ifndef PITH_SERVER_STORE_DATA_PLANE_H_
#define PITH_SERVER_STORE_DATA_PLANE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "common/ucx.h"
#include "server/store/blob_store.h"

namespace pith::store {

class DataPlane {
 public:
  // Serves `store`, whose arena is `arena` (registered with `worker`). Installs the
  // handlers on `worker` (before its Start()). Fails only if its metrics cannot be
  // registered.
  static absl::StatusOr<std::unique_ptr<DataPlane>> Create(ucx::Worker* worker, BlobStore* store,
                                                           const ucx::MemoryRegion* arena,
                                                           MetricsRegistry* metrics);

 private:
  DataPlane(ucx::Worker* worker, BlobStore* store, const ucx::MemoryRegion* arena)
      : worker_(worker), store_(store), memh_(arena ? arena->handle() : nullptr) {}
  void OnGet(ucx::AmMessage& message);
  void OnPut(ucx::AmMessage& message);
  void Reply(ucp_ep_h ep, uint16_t id, const v1::UcxBlobReply& reply, BlobRef payload);

  ucx::Worker* worker_;
  BlobStore* store_;
  ucp_mem_h memh_;
  prometheus::Counter* bytes_sent_ = nullptr;
  prometheus::Counter* bytes_received_ = nullptr;
  prometheus::Histogram* get_seconds_ = nullptr;
  prometheus::Histogram* put_seconds_ = nullptr;
  prometheus::Counter* errors_ = nullptr;
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_DATA_PLANE_H_
