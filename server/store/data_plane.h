// The store's UCX data plane: serves batched fetches straight from the RAM tier
// (registered memory; rendezvous sends, no copy) and receives new versions straight into
// RAM-tier blocks. Headers are the UcxGetRequest/UcxPutRequest/UcxBlobReply protos.
//
// Replies go over an endpoint the store opens to each client that says UcxHello, found by
// the request's client_id. Never over the endpoint UCX made for the client's connection
// (AmMessage::reply_ep) as such: UCX frees that one by itself when the client dies,
// possibly between a request's arrival and its reply, and then the dead client's messages
// still queued here name freed memory. Opening an endpoint back makes it the connection's
// (UCX matches the two), owned by the store and kept open until the store stops: a dead
// client's endpoint stays valid (failed; its late messages are dropped). The store opens
// one endpoint per peer address (every client id that says hello from one process shares
// it), and a new one only after the last failed. Per-client state is bounded: past
// kMaxClients, a hello from a new client id forgets the one idle longest (its next request
// is not answered: a StoreClient then connects again), and past kMaxEndpoints peer
// addresses a hello from a new one is refused. So a flood of hellos costs the store a
// bounded number of map entries and endpoints, whatever it sends.
//
// A put the RAM tier cannot take now (every block held by receives and reads in flight)
// waits, its payload left at the client (rendezvous) or in UCX's buffer, and later puts
// queue behind it: the store's RAM bounds what it receives at once, however much a step
// writes; each put's bytes go to the cold tier as it lands, so its RAM copy can be
// demoted for the next. Waiting puts are retried as puts land and every few
// milliseconds; one that waits kPutWaitLimit is refused with what holds the RAM.
//
// Thread safety: construction, Shutdown and destruction from the owner's thread (Shutdown
// before the UCX worker stops); everything else runs on the UCX progress thread, but for
// the retry ticker, which only posts there.
#ifndef PITH_SERVER_STORE_DATA_PLANE_H_
#define PITH_SERVER_STORE_DATA_PLANE_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/ucx.h"
#include "server/store/blob_store.h"

namespace pith::store {

// How long a put waits for RAM before it is refused.
inline constexpr absl::Duration kPutWaitLimit = absl::Seconds(20);
// Clients (StoreClients: about one per worker, coordinator or peer store process) and
// peer addresses (processes) the store keeps endpoints for, at most.
inline constexpr size_t kMaxClients = 4096;
inline constexpr size_t kMaxEndpoints = 8192;

class DataPlane {
 public:
  // Shutdown(), if it has not run.
  ~DataPlane();
  // Before the UCX worker stops (its endpoints close): no waiting put is started or
  // retried any more, and their payloads go back to UCX while their endpoints are open.
  // From the owner's thread; idempotent.
  void Shutdown();
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
  // Reserves RAM for a put and receives it; false (nothing done) when it must wait.
  bool TryPut(ucx::AmMessage& message, const v1::UcxPutRequest& request,
              std::chrono::steady_clock::time_point start);
  // Starts the waiting puts that fit now, in order; refuses those waiting too long.
  void RetryWaiting();
  // Answers client `client`; a request too malformed to name its client is answered when
  // `via` (the message's reply_ep, compared, never used) is an endpoint the store opened.
  // Dropped (and counted as an error) when the client is gone or unknown.
  void Reply(uint64_t client, ucp_ep_h via, uint16_t id, const v1::UcxBlobReply& reply,
             BlobRef payload);
  // Forgets a client: no more replies to it; its waiting puts are dropped.
  void RetireClient(uint64_t client);
  // The endpoint to the peer at `address` (made on its first hello).
  absl::StatusOr<ucp_ep_h> EndpointTo(const std::string& address);

  ucx::Worker* worker_;
  BlobStore* store_;
  ucp_mem_h memh_;
  struct Client {
    ucp_ep_h ep;
    uint64_t last_use;  // uses_ at its hello or last answer
  };
  std::map<uint64_t, Client> clients_;  // by UcxHello.client_id
  uint64_t uses_ = 0;
  std::map<std::string, ucp_ep_h> endpoints_;  // by peer address: open, not failed
  struct WaitingPut {
    ucx::AmMessage message;
    v1::UcxPutRequest request;
    std::chrono::steady_clock::time_point start;
  };
  std::deque<WaitingPut> waiting_;
  bool retrying_ = false;  // RetryWaiting is running (it is not re-entered)
  bool stopping_ = false;  // Shutdown ran: puts are refused, none is retried
  // The ticker: posts RetryWaiting every few milliseconds while waiting_ is not empty.
  std::atomic<bool> has_waiting_{false};
  absl::Notification stop_ticker_;
  std::thread ticker_;
  prometheus::Counter* bytes_sent_ = nullptr;
  prometheus::Counter* bytes_received_ = nullptr;
  prometheus::Histogram* get_seconds_ = nullptr;
  prometheus::Histogram* put_seconds_ = nullptr;
  prometheus::Counter* errors_ = nullptr;
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_DATA_PLANE_H_
