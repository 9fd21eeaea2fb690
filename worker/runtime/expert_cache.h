// ExpertCache: the worker's fixed-slot pool of expert weights (DESIGN §6 step 3). One
// allocation of UCX-registered memory, cut into slots of one expert blob each (no
// allocation per fetch); least recently used slots are reused; a slot is pinned while
// compute reads it; a prefetcher on its own thread fetches the experts the owner will
// need next (its compute order: forward through the layers, backward, the updates) into
// free slots while the current ones compute.
//
// Contents are always the bytes of a committed version in the stores, or the owner's own
// update of them (Store), so a hit and a miss give the same bits: caching never changes
// the math.
//
// Thread safety: all methods are thread-safe; the fetch function runs on the caller's or
// the prefetcher's thread. The prefetcher fetches up to kPrefetchBatch experts at a time.
#ifndef PITH_WORKER_RUNTIME_EXPERT_CACHE_H_
#define PITH_WORKER_RUNTIME_EXPERT_CACHE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/ucx.h"

namespace pith::runtime {

class ExpertCache {
 public:
  using Expert = std::pair<int, int>;  // (layer, expert)
  static constexpr int kPrefetchBatch = 4;
  // One expert for the fetch function: fill `dst` (slot_bytes, in the cache's registered
  // memory) with its weights from the stores: the newest version, or with `updating` (an
  // update of it is in flight, BeginUpdates) the one the update starts from.
  struct FetchRequest {
    Expert expert;
    void* dst = nullptr;
    bool updating = false;
    absl::Status status;  // set by the fetch function
  };
  // Fetches every request (the prefetcher asks for several at once: one round trip per
  // store group, not per expert), setting each one's status; returns the first error.
  using FetchFn =
      std::function<absl::Status(absl::Span<FetchRequest> requests, size_t bytes, ucp_mem_h memh)>;

  struct Stats {
    uint64_t hits = 0, misses = 0, prefetch_hits = 0;
    uint64_t bytes_fetched = 0;
    double seconds_fetching = 0;
    uint64_t resident_bytes = 0;
  };

  // `slots` slots of `slot_bytes` in `memory` (registered, slots * slot_bytes bytes, not
  // owned... kept alive by the cache). At least 2 slots. An Acquire that finds every slot
  // pinned waits up to `pinned_wait` for a Release (pins held by other threads: writes
  // sending from their slots) before it fails.
  static absl::StatusOr<std::unique_ptr<ExpertCache>> Create(
      std::unique_ptr<ucx::MemoryRegion> memory, size_t slot_bytes, int slots, FetchFn fetch,
      absl::Duration pinned_wait = absl::ZeroDuration());
  ~ExpertCache();  // stops the prefetcher

  int slots() const { return slot_count_; }
  size_t slot_bytes() const { return slot_bytes_; }
  // The slots' memory (slots * slot_bytes bytes), and the slot an acquired pointer is in.
  uint8_t* memory() const { return memory_->data(); }
  int SlotOf(const void* weights) const {
    return static_cast<int>((static_cast<const uint8_t*>(weights) - memory_->data()) /
                            static_cast<std::ptrdiff_t>(slot_bytes_));
  }
  // A number that changes whenever the bytes of the slot holding `expert` do (a fetch
  // landed, an update applied): the same number, the same bytes. Stable while the expert
  // is pinned by the caller; 0 when it is not resident.
  uint64_t Generation(Expert expert);

  // The weights of `expert`, fetched on a miss (waiting for a prefetch in flight); pinned
  // until Release. RESOURCE_EXHAUSTED when every slot stays pinned for the pinned wait.
  // While an update of `expert` is in flight (BeginUpdates), waits for it first.
  absl::StatusOr<float*> Acquire(Expert expert);
  // The consumer's (compute thread's) take of one of `experts` (one layer's, whose compute
  // order does not change the math), pinned: the first that is ready (resident and not
  // waiting for its update), else, while some are on their way (being fetched, or
  // resident and waiting for their update), the first to get there, else the first,
  // fetched here. Returns its index in `experts` and its weights. The schedule's entries
  // of that layer at the consumer's position that are not in `experts` (no rows here this
  // step) are dropped; the others stay ahead of the consumer until taken.
  absl::StatusOr<std::pair<size_t, float*>> AcquireAny(absl::Span<const Expert> experts);
  void Release(Expert expert);

  // Updates applied in place on another thread while compute goes on (the owner's
  // optimizer step of the step before): from BeginUpdates until Updated(x), Acquire(x)
  // waits, so compute never reads weights the update has not reached; AcquireForUpdate(x)
  // does not (it is the update's own read: it waits only for a slot, or for a fetch of x
  // in flight) and leaves the schedule's cursor alone. A fetch of such an expert (the
  // prefetcher may make one) reads the version the update starts from (the fetch
  // function is told); one in flight as BeginUpdates is called is thrown away. One set of
  // updates at a time: BeginUpdates replaces the last set, which must have ended.
  void BeginUpdates(absl::Span<const Expert> experts);
  absl::StatusOr<float*> AcquireForUpdate(Expert expert);
  void Updated(Expert expert);
  // Ends the updates: with an error, the experts not updated stay unreadable (Acquire and
  // AwaitUpdates return `status`) until the next BeginUpdates.
  void EndUpdates(const absl::Status& status);
  // Waits until every update begun has been applied (OK) or the updates failed.
  absl::Status AwaitUpdates();

  // The order experts will be acquired in this step; the prefetcher works through it.
  void SetSchedule(std::vector<Expert> order);
  // The experts of `layer` about to be acquired, in this order (its routing, known just
  // before its experts compute, in the forward): they replace the schedule's guesses for
  // the layers up to `layer` still ahead of the consumer (the forward's run of entries in
  // layer order there), so the prefetcher fetches those not resident first, keeps them
  // until they are acquired, and looks past them to the next layer's.
  void Expect(int layer, absl::Span<const Expert> experts);
  // Drops every unpinned entry (after an aborted step its updates are void).
  void Clear();
  // Drops one entry if it is not pinned (another worker updated the expert).
  void Invalidate(Expert expert);
  Stats stats();
  // The fetches of each expert into the cache (misses and prefetches) since the last
  // call, which resets them: how often each expert is swapped in.
  std::map<Expert, uint64_t> TakeFetchCounts();

 private:
  struct Slot {
    Expert expert{-1, -1};
    bool valid = false;       // holds the expert's bytes
    bool fetching = false;    // a fetch is filling it
    bool prefetched = false;  // filled by the prefetcher, not acquired since
    int pins = 0;
    uint64_t last_use = 0;
    bool stale = false;       // invalidated while a fetch was filling it: discard the result
    uint64_t generation = 0;  // Generation(): set as its bytes change
  };
  ExpertCache() = default;
  // A slot to reuse: free, or the least recently used unpinned one not scheduled soon.
  int VictimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Prefetch();
  // Fills slot `victim` with `expert` (pinned `pins` times), fetching without mu_ held:
  // true when it holds the expert, false when it was invalidated meanwhile (the slot is
  // free again), the fetch's error otherwise (the slot is free again). Requires mu_.
  absl::StatusOr<bool> FillLocked(int victim, Expert expert, int pins)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills the slots of `victims` (claimed by ClaimLocked) with their experts in one fetch,
  // without mu_ held, and lands each (landed[i]: slot victims[i] holds its expert);
  // returns the fetch's status.
  absl::Status FetchClaimedLocked(const std::vector<int>& victims, std::vector<bool>* landed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks slot `victim` as being filled with `expert`.
  void ClaimLocked(int victim, Expert expert, int pins) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the fill of slot `victim` (claimed for `expert`) with `status`: true when it holds
  // the expert, false when it was invalidated meanwhile or the fetch failed (the slot is
  // free again).
  bool LandLocked(int victim, Expert expert, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Acquire's body; `consumer`: the compute's acquire (waits for the expert's update);
  // `move_cursor`: the consumer's position moves just past the expert's next entry.
  absl::StatusOr<float*> AcquireLocked(Expert expert, bool consumer, bool move_cursor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `expert` can be acquired with no wait: resident, not being filled, and its
  // update (if any) applied (or the updates failed: the acquire returns their error).
  bool ReadyLocked(Expert expert) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  float* SlotData(int i) const {
    return reinterpret_cast<float*>(memory_->data() + static_cast<size_t>(i) * slot_bytes_);
  }

  std::unique_ptr<ucx::MemoryRegion> memory_;
  size_t slot_bytes_ = 0;
  int slot_count_ = 0;  // slots_.size(), fixed at Create: read without mu_
  FetchFn fetch_;
  absl::Duration pinned_wait_;

  absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::map<Expert, int> index_ ABSL_GUARDED_BY(mu_);  // expert -> slot
  std::vector<Expert> schedule_ ABSL_GUARDED_BY(mu_);
  size_t cursor_ ABSL_GUARDED_BY(mu_) = 0;  // next schedule entry the consumer acquires
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generations_ ABSL_GUARDED_BY(mu_) = 0;   // the last slot generation handed out
  std::set<Expert> updating_ ABSL_GUARDED_BY(mu_);  // updates in flight (BeginUpdates)
  absl::Status updates_failed_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::map<Expert, uint64_t> fetch_counts_ ABSL_GUARDED_BY(mu_);  // since TakeFetchCounts
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread prefetcher_;
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_EXPERT_CACHE_H_
