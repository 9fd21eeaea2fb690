// The worker's store I/O (DESIGN §4, §6): which stores hold each group of blobs (the
// dense tensors; each expert), connections to them, queued puts and their flush, fetches
// (committed versions, or the pending step's), and the step pending a commit.
//
// BlobIo is what the expert updater needs of it (tests fake it); StoreIo is the real one
// over a StoreClient, and also the cache's fetch function.
//
// Thread safety: StoreIo is thread-safe; its mutex mu_ guards the store groups, the
// connections, the pending step, the registered regions and the record of this step's
// writes. The training thread changes the groups (ApplyPlacement) and the pending step;
// the cache's prefetch thread fetches (FetchWeights); the update and flush threads fetch,
// put and flush. A PutQueue is not shared: one thread at a time fills and flushes it.
#ifndef PITH_WORKER_RUNTIME_STORE_IO_H_
#define PITH_WORKER_RUNTIME_STORE_IO_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "pith/v1/coordinator.pb.h"
#include "server/store/store_client.h"
#include "worker/runtime/expert_cache.h"
#include "worker/runtime/worker_metrics.h"

namespace pith::runtime {

// A store that does not answer within this is taken for dead (its lease then runs out).
inline constexpr absl::Duration kStoreTimeout = absl::Seconds(10);

// A group of blobs stored together: (layer, expert) of an expert, kDenseGroup for the
// dense tensors.
using StoreGroup = std::pair<int, int>;
inline constexpr StoreGroup kDenseGroup{-1, 0};

// The key of a blob of job `job_id`: a dense tensor (layer < 0: by name) or an expert.
v1::BlobKey BlobKeyOf(const std::string& job_id, int layer, int expert, const std::string& tensor,
                      v1::BlobKind kind);
// A fetch of `key` into `buffer` (`bytes` of it), the committed version.
store::StoreClient::FetchItem FetchItemOf(const v1::BlobKey& key, void* buffer, size_t bytes);

// `failure` of the puts of `items` with the store it came from named ("store ID: ..."):
// that of the item whose status it is (`store_peer`: store id -> peer). A full disk's
// store goes in its payload too (DiskFullStore: the failure report's full_store_id).
// A full disk's path says nothing of which store it is, and stores on several hosts often
// share their --data_dir paths.
absl::Status NamePutFailure(absl::Span<const store::StoreClient::PutItem> items,
                            const std::map<std::string, int>& store_peer, absl::Status failure);

// Puts queued by BlobIo::Put, sent by BlobIo::Flush.
struct PutQueue {
  std::vector<store::StoreClient::PutItem> items;
  std::vector<bool> primary;  // the item goes to its group's first store
  bool empty() const { return items.empty(); }
  void clear() {
    items.clear();
    primary.clear();
  }
};

// Registered memory the puts send from: their registration is looked up here.
enum class Region { kSlots, kMoments };

class BlobIo {
 public:
  virtual ~BlobIo() = default;
  // A group's stores to read from (complete copies, primary first) and to write to (the
  // same, then those joining the group); copies: a new placement may replace them.
  virtual std::vector<std::string> ReadStores(StoreGroup group) = 0;
  virtual std::vector<std::string> WriteStores(StoreGroup group) = 0;
  // Reads `items` (each at its version) from the first of `stores` that answers.
  virtual absl::Status Fetch(const std::vector<std::string>& stores,
                             std::vector<store::StoreClient::FetchItem>& items) = 0;
  // Queues one blob's new version for every store of `stores`; `data` must stay put
  // until the queue is flushed.
  virtual absl::Status Put(const std::vector<std::string>& stores, const v1::BlobKey& key,
                           int64_t version, const void* data, size_t bytes, PutQueue& queue) = 0;
  // Sends `queue` (all in flight at once) and empties it; records what the primary stores
  // wrote. `buffers_free` as StoreClient::PutMany's.
  virtual absl::Status Flush(PutQueue& queue,
                             const std::function<void(const absl::Status&)>& buffers_free) = 0;
  // The version of the pending step if it wrote `expert`, else -1 (the committed one).
  virtual int64_t PendingVersion(StoreGroup expert) = 0;
  // Registered memory (huge pages where the kernel allows) for blobs to go to and from
  // the stores.
  virtual absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> AllocateBuffer(size_t bytes) = 0;
  virtual void SetRegion(Region region, const uint8_t* data, size_t bytes, ucp_mem_h memh) = 0;
};

class StoreIo : public BlobIo {
 public:
  StoreIo(store::StoreClient* client, WorkerMetrics* metrics, std::string job_id, int experts)
      : client_(client), metrics_(metrics), job_id_(std::move(job_id)), experts_(experts) {}

  // Takes the placement's store groups and connects to its stores not connected yet. The
  // puts from now on name the assignment's version as their attempt (the stores fence off
  // a voided attempt's late writes with it).
  absl::Status ApplyPlacement(const v1::Assignment& a) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<std::string> ReadStores(StoreGroup group) override ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::string> WriteStores(StoreGroup group) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Fetch(const std::vector<std::string>& stores,
                     std::vector<store::StoreClient::FetchItem>& items) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Put(const std::vector<std::string>& stores, const v1::BlobKey& key, int64_t version,
                   const void* data, size_t bytes, PutQueue& queue) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Flush(PutQueue& queue,
                     const std::function<void(const absl::Status&)>& buffers_free) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Flush(PutQueue& queue) { return Flush(queue, nullptr); }
  // Queues the four versions (weights, master, moments) of the expert (layer, expert) or
  // dense `tensor` (layer -1) for `stores`: the weights are `blob` (`blob_bytes`: a bf16
  // expert's form, common/bf16.h) when given, else the fp32 master `w` itself.
  absl::Status PutParams(const std::vector<std::string>& stores, int layer, int expert,
                         const std::string& tensor, int64_t version, const float* w, const float* m,
                         const float* v, size_t bytes, PutQueue& queue, const void* blob = nullptr,
                         size_t blob_bytes = 0) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t PendingVersion(StoreGroup expert) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> AllocateBuffer(size_t bytes) override {
    return client_->AllocateBuffer(bytes);
  }
  void SetRegion(Region region, const uint8_t* data, size_t bytes, ucp_mem_h memh) override
      ABSL_LOCKS_EXCLUDED(mu_);

  // The cache's fetch function: the newest versions of the requested experts' weights,
  // one fetch per store group (on the caller's or the prefetch thread).
  absl::Status FetchWeights(absl::Span<ExpertCache::FetchRequest> requests, size_t bytes,
                            ucp_mem_h memh) ABSL_LOCKS_EXCLUDED(mu_);

  // Step s is written and reported (written[layer * E + expert]: it wrote the expert);
  // reads then ask for its versions. ClearPending: it settled.
  void SetPending(int64_t s, std::vector<bool> written) ABSL_LOCKS_EXCLUDED(mu_);
  void ClearPending() ABSL_LOCKS_EXCLUDED(mu_);
  bool Pending() ABSL_LOCKS_EXCLUDED(mu_);

  // What the primary stores recorded for the writes flushed since ClearWritten.
  void ClearWritten() ABSL_LOCKS_EXCLUDED(mu_);
  google::protobuf::RepeatedPtrField<v1::BlobInfo> Written() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Registered {
    const uint8_t* data = nullptr;
    size_t bytes = 0;
    ucp_mem_h memh = nullptr;
  };

  // The peer id of a connected store, -1 if none.
  int StorePeer(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // The registration of registered memory holding [data, data + bytes): a cache slot or
  // a moment buffer; null for the rest (UCX registers or copies it itself).
  ucp_mem_h Registration(const void* data, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // As Fetch, with item i at the pending step's version when it wrote the expert and
  // `updating[i]` is false (the update reads the committed one).
  absl::Status FetchNewest(const std::vector<std::string>& stores,
                           std::vector<store::StoreClient::FetchItem>& items,
                           const std::vector<bool>& updating) ABSL_LOCKS_EXCLUDED(mu_);

  store::StoreClient* const client_;
  WorkerMetrics* const metrics_;
  const std::string job_id_;
  const int experts_;  // E, for pending_written_

  absl::Mutex mu_;
  int64_t attempt_ ABSL_GUARDED_BY(mu_) = 0;  // the assignment version puts name
  std::map<StoreGroup, std::vector<std::string>> read_stores_ ABSL_GUARDED_BY(mu_);
  std::map<StoreGroup, std::vector<std::string>> write_stores_ ABSL_GUARDED_BY(mu_);
  // Member id -> its StoreClient peer (which reconnects by itself after a failure) and
  // the address that peer is for.
  std::map<std::string, int> store_peer_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> store_address_ ABSL_GUARDED_BY(mu_);
  std::map<Region, Registered> regions_ ABSL_GUARDED_BY(mu_);
  // The step written and reported but not known to be committed while the next one
  // computes (-1: none), and which experts it wrote.
  int64_t pending_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<bool> pending_written_ ABSL_GUARDED_BY(mu_);  // layer * E + expert
  google::protobuf::RepeatedPtrField<v1::BlobInfo> written_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_STORE_IO_H_
