// StoreClient: the worker side of the store's UCX data plane. Fetches blobs straight into
// caller memory (registered with AllocateBuffer for zero-copy), many per call with one
// completion, and writes new versions from caller memory.
//
// Thread safety: all methods are thread-safe and may be called concurrently; each call
// blocks its caller until done. Buffers must stay valid until the call returns.
#ifndef PITH_SERVER_STORE_STORE_CLIENT_H_
#define PITH_SERVER_STORE_STORE_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/pause_watch.h"
#include "common/ucx.h"
#include "pith/v1/store.pb.h"

namespace pith::store {

class StoreClient {
 public:
  // `retired_linger`: how long a timed-out endpoint stays open for late answers (see
  // kRetiredLinger; tests shorten it).
  static absl::StatusOr<std::unique_ptr<StoreClient>> Create(
      absl::Duration retired_linger = kRetiredLinger);
  ~StoreClient();

  // Opens (or reuses) an endpoint to the store whose packed UCX address this is (from
  // StoreService.GetUcxAddress). Returns a peer id for the calls below, valid for the
  // client's life: when a call to it times out or its endpoint fails, that call fails, so
  // do the fetches of the next kReconnectBackoff (doubling with each failure in a row, up
  // to kMaxReconnectBackoff; UNAVAILABLE at once, so a caller moves on to a replica), and
  // the next call after it, or the next put at once, opens a new endpoint (and says hello
  // again). While kMaxRetiredEndpoints connections have timed out within kRetiredLinger,
  // a failed store is not reconnected (UNAVAILABLE) until the oldest of them is closed.
  absl::StatusOr<int> Connect(const std::string& ucx_address);

  // Registered memory for fetch targets and put sources (see ucx::Worker::Allocate).
  absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> AllocateBuffer(size_t bytes,
                                                                    bool fault_in = true);

  struct FetchItem {
    v1::BlobKey key;
    int64_t version = -1;  // -1: the committed version
    void* buffer = nullptr;
    size_t capacity = 0;
    ucp_mem_h memh = nullptr;  // the buffer's registration, if any
    // Filled in:
    absl::Status status;
    v1::BlobInfo info;
  };
  // Fetches every item (in one request, or several when their keys would not fit one
  // UCX message header). OK when all items are; otherwise the first error,
  // with each item's own status set. DEADLINE_EXCEEDED after `timeout` (the endpoint is
  // then closed so that nothing is written into the buffers after return). Each blob is
  // checked end to end once it landed: the key and version answered are the ones asked
  // for (a committed fetch: any), and its bytes match the CRC32C the store recorded at
  // write; otherwise DATA_LOSS naming the blob.
  absl::Status Fetch(int peer, absl::Span<FetchItem> items,
                     absl::Duration timeout = absl::Seconds(30));
  // The end-to-end check of one fetched item (see Fetch): OK or DATA_LOSS.
  static absl::Status CheckFetched(const FetchItem& item);

  struct PutItem {
    int peer = -1;
    v1::BlobKey key;
    int64_t version = 0;
    int64_t attempt = 0;         // of the step it belongs to (UcxPutRequest.attempt); 0: none
    const void* data = nullptr;  // valid until PutMany returns (or calls buffers_free)
    size_t size = 0;
    ucp_mem_h memh = nullptr;
    // Filled in:
    absl::Status status;
    v1::BlobInfo info;
    bool by_reference = false;  // sent as a reference to a sibling's bytes: no payload
  };
  // Writes every item, all in flight at once (to one store or several); returns when all
  // are answered: OK when all are, else the first error, each item's status set. An item
  // with the same buffer, version and store as another's of the sibling kind (weights and
  // master of one expert or tensor) is sent after it, as a reference (no payload).
  // `buffers_free`, if set, is called (on the calling thread) as soon as no item's buffer
  // is read any more: once the payloads are answered, before the references go; with
  // their status.
  absl::Status PutMany(absl::Span<PutItem> items, absl::Duration timeout = absl::Seconds(30),
                       const std::function<void(const absl::Status&)>& buffers_free = nullptr);

  // Writes (key, version) from `data`; returns what the store recorded.
  absl::StatusOr<v1::BlobInfo> Put(int peer, const v1::BlobKey& key, int64_t version,
                                   const void* data, size_t size, ucp_mem_h memh = nullptr,
                                   absl::Duration timeout = absl::Seconds(30));

  static constexpr absl::Duration kReconnectBackoff = absl::Seconds(1);
  static constexpr absl::Duration kMaxReconnectBackoff = absl::Seconds(30);
  static constexpr size_t kMaxRetiredEndpoints = 64;
  // A timed-out endpoint is closed this long after its timeout: far past any answer of a
  // store that is running (a store answers or gives up on a request within seconds), so
  // the bound above limits the endpoints open at once, not the timeouts in a lifetime.
  static constexpr absl::Duration kRetiredLinger = absl::Minutes(10);

 private:
  struct Pending;
  struct Round;
  StoreClient() = default;
  void OnReply(ucx::AmMessage& message, bool is_get);
  // Sends items[round] (those with source[i] >= 0 as references to items[source[i]],
  // written before) and waits for them.
  absl::Status PutRound(absl::Span<PutItem> items, const std::vector<size_t>& round,
                        const std::vector<int>& source, absl::Time deadline, absl::Duration budget);
  // Sends request `id` (on the progress thread) and waits for its replies.
  // Fetch's one request (of at most kMaxRequestBytes of header).
  absl::Status FetchOnce(int peer, absl::Span<FetchItem> items, absl::Time deadline,
                         absl::Duration budget);
  struct Down {  // a peer whose last endpoint failed
    absl::Duration backoff;
    absl::Time retry_at;
    std::string why;
  };
  static constexpr size_t kMaxRequestBytes = 4096;
  static constexpr size_t kItemOverheadBytes = 32;  // an item's version, capacity, framing
  // Fetched items of kCheckOnCallerBytes or more are checked end to end by the waiting
  // caller, those under it on the progress thread as they land (see Pending::landed).
  static constexpr size_t kCheckOnCallerBytes = 4u << 20;
  // `on_landed(i)`: called on this thread for each fetch item i of kCheckOnCallerBytes or
  // more whose payload has landed, while the others are still in flight (null: none).
  // Waits until `deadline`; `budget` is the whole call's time, which a timeout names.
  absl::Status Issue(int peer, uint64_t id, const std::shared_ptr<Pending>& pending,
                     uint16_t message, std::string header, const void* data, size_t size,
                     ucp_mem_h memh, absl::Time deadline, absl::Duration budget,
                     const std::function<void(size_t)>& on_landed = nullptr);
  absl::Status Wait(int peer, const std::shared_ptr<Pending>& pending, absl::Time deadline,
                    absl::Duration budget, const std::function<void(size_t)>& on_landed = nullptr);
  // The `deadline` of a call of `budget` (begun at deadline - budget), moved on by however
  // long this process did not run since it began (a stopped worker does not blame a store).
  static absl::Time Running(absl::Time deadline, absl::Duration budget) {
    const absl::Duration began = SteadyNow() - (absl::Now() - (deadline - budget));
    return deadline + StoppedSince(began);
  }
  void FailPeer(int peer, const absl::Status& status);
  // Progress thread. The open endpoint to `peer`, or a new one when its last one failed or
  // was retired (FailPeer); with `fail_fast`, UNAVAILABLE instead while its backoff runs.
  absl::StatusOr<ucp_ep_h> Endpoint(int peer, bool fail_fast);

  std::unique_ptr<ucx::Worker> worker_;
  std::atomic<uint64_t> next_request_{1};
  uint64_t client_id_ = 0;  // UcxHello.client_id: random, set once
  // Progress thread only:
  std::map<int, ucp_ep_h> peers_;          // open endpoints
  std::map<int, std::string> address_of_;  // every peer id handed out
  std::map<int, Down> down_;
  std::map<std::string, int> peer_by_address_;
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;
  struct Retired {
    ucp_ep_h ep;
    std::chrono::steady_clock::time_point at;  // its timeout
  };
  // Closes the retired endpoints older than retired_linger_.
  void CloseLingeredRetired();
  absl::Duration retired_linger_ = kRetiredLinger;
  // Timed out, left open (see FailPeer), oldest first; closed after retired_linger_, or
  // with the client.
  std::deque<Retired> retired_;
  int next_peer_ = 1;
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_STORE_CLIENT_H_
