// The store's UCX data plane: serves batched fetches straight from the RAM tier
// (registered memory; rendezvous sends, no copy) and receives new versions straight into
// RAM-tier blocks. Headers are the UcxGetRequest/UcxPutRequest/UcxBlobReply protos.
//
// Replies go over an endpoint the store opens to each client that says UcxHello, found by
// the request's client_id. Never over the endpoint UCX made for the client's connection
// (AmMessage::reply_ep) as such: UCX frees that one by itself when the client dies,
// possibly between a request's arrival and its reply, and then the dead client's messages
// still queued here name freed memory. Opening an endpoint back makes it the connection's
// (UCX matches the two), owned by the store: a dead client's endpoint stays valid (failed;
// its late messages are dropped) and is only retired, closed when the store stops. One
// endpoint per client connection the store ever had: a few per worker restart.
//
// Thread safety: construction and destruction from the owner's thread; everything else
// runs on the UCX progress thread.
#ifndef PITH_SERVER_STORE_DATA_PLANE_H_
#define PITH_SERVER_STORE_DATA_PLANE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

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
  void OnHello(ucx::AmMessage& message);
  void OnGet(ucx::AmMessage& message);
  void OnPut(ucx::AmMessage& message);
  // Answers client `client`; a request too malformed to name its client is answered when
  // `via` (the message's reply_ep, compared, never used) is an endpoint the store opened.
  // Dropped (and counted as an error) when the client is gone or unknown.
  void Reply(uint64_t client, ucp_ep_h via, uint16_t id, const v1::UcxBlobReply& reply,
             BlobRef payload);
  // The client's endpoint goes to retired_: no more replies over it; open until Stop.
  void RetireClient(uint64_t client);

  ucx::Worker* worker_;
  BlobStore* store_;
  ucp_mem_h memh_;
  struct Client {
    ucp_ep_h ep;
    uint64_t connection;  // numbers the store's connections: tells an old one's failure
  };
  std::map<uint64_t, Client> clients_;  // by UcxHello.client_id
  uint64_t connections_ = 0;
  std::vector<ucp_ep_h> retired_;  // failed or replaced; the worker closes them
  prometheus::Counter* bytes_sent_ = nullptr;
  prometheus::Counter* bytes_received_ = nullptr;
  prometheus::Histogram* get_seconds_ = nullptr;
  prometheus::Histogram* put_seconds_ = nullptr;
  prometheus::Counter* errors_ = nullptr;
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_DATA_PLANE_H_
