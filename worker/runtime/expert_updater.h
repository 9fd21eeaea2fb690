// ExpertUpdater: AdamW on the experts this worker updates (it is their primary owner),
// exactly as AdamWOptimizer::Apply does it (DESIGN §3, §6): the weights in their cache
// slots, the moments of the committed step from the stores (or resident here), the
// update counts kept here; the new versions go straight back to the stores. For a bf16
// job the slots hold the bf16 weights blob: AdamW runs on the fp32 master, fetched (or
// kept) with the moments, and the slot gets the new master's bf16 form (common/bf16.h).
// Experts go in batches: one fetch per store group for a batch's moments, one flush for
// its writes.
//
// Pipelined (Launch), a step's updates and writes go on on threads of their own while the
// next step computes; Launch returns an UpdateHandle, the one thing to wait on.
//
// Thread safety: phases, not locks. The training thread calls SetUp, StartEarlyMoments,
// DropEarlyMoments, UpdateNow and Launch, never while a launched update runs (its handle
// not yet waited for), except StartEarlyMoments and DropEarlyMoments, which touch only
// the scratch segments the last update has freed (they wait for that). A launched update
// owns the moment buffers, counts and queued writes until its handle is waited for. The
// destructor waits for every task.
#ifndef PITH_WORKER_RUNTIME_EXPERT_UPDATER_H_
#define PITH_WORKER_RUNTIME_EXPERT_UPDATER_H_

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/param_layout.h"
#include "worker/compute/cpu_backend.h"
#include "worker/model/optimizer.h"
#include "worker/runtime/expert_cache.h"
#include "worker/runtime/grad_pool.h"
#include "worker/runtime/memory_plan.h"
#include "worker/runtime/store_io.h"
#include "worker/runtime/task_threads.h"

namespace pith::runtime {

// Most scratch moment segments (a small cache budget): batch k of a step's updates uses
// segment k % ring_, so that later batches' moments are fetched while batch k is updated
// and the writes of the batches before it go on.
inline constexpr int kMaxRing = 4;

// A launched step's updates, writes and what follows them (Launch's `then`).
class UpdateHandle {
 public:
  UpdateHandle() = default;
  explicit UpdateHandle(std::future<absl::Status> done) : done_(std::move(done)) {}
  // Launched and not yet waited for.
  bool pending() const { return done_.valid(); }
  // Waits for it; its status (OK when none is pending).
  absl::Status Wait() { return done_.valid() ? done_.get() : absl::OkStatus(); }

 private:
  std::future<absl::Status> done_;
};

class ExpertUpdater {
 public:
  using Expert = ExpertCache::Expert;

  // How step s's expert updates and writes overlap the work after them. kNone: they end
  // before the step's Write returns (UpdateNow), when a worker reads another's update of
  // an expert from the stores (an expert has two owners). Otherwise they go on while the
  // next step computes (Launch): kAll when every expert updated here has its own moment
  // buffer (the writes go once all are updated, from slots pinned until then); kBatches
  // (scratch moments): each update batch's writes start as soon as it is updated, from
  // its slots (pinned until they land: a read of the expert meanwhile is a hit) and its
  // scratch segment (refilled once they have landed).
  enum class Overlap { kNone, kAll, kBatches };

  struct Deps {
    std::string job_id;
    BlobIo* io = nullptr;
    ExpertCache* cache = nullptr;
    const model::ParamLayout* layout = nullptr;
    const model::OptimizerConfig* config = nullptr;
    GradPool* grads = nullptr;                      // the experts' gradients of the step
    compute::CpuBackend* backend = nullptr;         // the training thread's (UpdateNow)
    compute::CpuBackend* update_backend = nullptr;  // a launched update's
  };
  explicit ExpertUpdater(Deps deps) : d_(std::move(deps)) {}
  ~ExpertUpdater();
  ExpertUpdater(const ExpertUpdater&) = delete;
  ExpertUpdater& operator=(const ExpertUpdater&) = delete;

  // Moment buffers for `updated` (the experts updated here), resident or a scratch ring
  // as `plan` says (PlanMemory).
  absl::Status SetUp(const std::vector<Expert>& updated, const MomentPlan& plan);
  // `shared`: an expert has several owners.
  Overlap OverlapWrites(bool shared) const;

  // In step s's backward, with scratch moments (kBatches): fetches the moments and counts
  // of the first update batches of `used` ahead of the update (Launch uses them).
  void StartEarlyMoments(std::vector<Expert> used, Overlap overlap);
  // Waits for an early fetch that will not be used.
  void DropEarlyMoments();

  // Step s's updates of `used` (updated here, got tokens) on the calling thread, then
  // `queue` (writes queued before them) and theirs flushed (kNone).
  absl::Status UpdateNow(int64_t s, double grad_norm, const std::vector<Expert>& used,
                         PutQueue queue);
  // The same, pipelined (kAll, kBatches) on threads of their own; the caller has begun
  // the updates in the cache (BeginUpdates). Once all writes have landed, `then` runs
  // there; the handle ends with its status, or the first failure.
  UpdateHandle Launch(int64_t s, double grad_norm, Overlap overlap, std::vector<Expert> used,
                      PutQueue queue, std::function<absl::Status()> then);

  size_t update_batch() const { return update_batch_; }
  size_t ring() const { return ring_; }
  bool resident() const { return !moment_index_.empty(); }

 private:
  // The batches of `used` and each expert's moment buffer, per batch.
  struct Plan {
    std::vector<absl::Span<const Expert>> batches;
    std::vector<std::vector<size_t>> buffers;
  };
  Plan PlanBatches(const std::vector<Expert>& used) const;
  absl::Status UpdateExperts(int64_t s, double grad_norm, Overlap overlap,
                             const std::vector<Expert>& used,
                             std::future<absl::Status> early_moments = {},
                             const std::vector<Expert>& early_used = {});
  // The fetcher of UpdateExperts: fills the batches' segments ahead of the updates.
  void FetchAhead(const Plan& plan, const std::vector<Expert>& used, size_t early, bool reuse,
                  std::vector<std::shared_future<absl::Status>>& segment_free,
                  std::vector<std::promise<absl::Status>>& fetched);
  absl::Status FetchMoments(absl::Span<const Expert> batch, const std::vector<size_t>& buffer,
                            const std::vector<int64_t>* versions = nullptr);
  absl::Status UpdateBatch(int64_t s, double grad_norm, absl::Span<const Expert> batch,
                           const std::vector<size_t>& buffer, Overlap overlap);
  // AdamW on `batch` (its weights at `w`, moments in `buffer`), on `backend`.
  absl::Status ApplyBatch(int64_t s, double grad_norm, absl::Span<const Expert> batch,
                          const std::vector<size_t>& buffer, const std::vector<float*>& w,
                          compute::CpuBackend& backend);
  std::shared_future<absl::Status> LaunchFlush(absl::Span<const Expert> batch,
                                               std::promise<absl::Status> landed);
  // The launched update's body (on a task thread).
  absl::Status RunLaunched(int64_t s, double grad_norm, Overlap overlap,
                           const std::vector<Expert>& used, std::future<absl::Status> early,
                           const std::vector<Expert>& early_used,
                           std::promise<absl::Status> segments_free,
                           const std::function<absl::Status()>& then);
  // After a failed update: nothing more is sent; the pins of held writes are dropped.
  void DropWrites();
  v1::BlobKey Key(int layer, int expert, v1::BlobKind kind) const {
    return BlobKeyOf(d_.job_id, layer, expert, "", kind);
  }
  // An expert's buffer: adam_m, adam_v and, for a bf16 job, the fp32 master weights (the
  // cache's slots hold the bf16 weights blob).
  float* M(size_t buffer) {
    return reinterpret_cast<float*>(moment_memory_->data()) + kinds() * buffer * floats();
  }
  float* V(size_t buffer) { return M(buffer) + floats(); }
  float* Master(size_t buffer) { return M(buffer) + 2 * floats(); }
  int64_t floats() const { return d_.layout->shape().expert_floats(); }
  bool bf16() const { return d_.layout->shape().compute_dtype == ComputeDtype::kBf16; }
  size_t kinds() const { return bf16() ? 3 : 2; }

  const Deps d_;
  size_t update_batch_ = 1;
  size_t ring_ = 1;  // scratch moment segments
  // Moment buffers (SetUp): adam_m and adam_v (and a bf16 job's master) of an expert each,
  // one per updated expert (moment_index_) or one per expert of an update batch. The
  // fetcher reads the current flags (these and the counts') of some experts while the
  // update thread sets others': bytes, not bits.
  std::unique_ptr<ucx::MemoryRegion> moment_memory_;
  std::vector<uint8_t> moment_current_;    // the buffer holds the expert's newest moments
  std::map<Expert, size_t> moment_index_;  // empty: scratch
  // The AdamW count of each expert updated here (count_index_), fetched only while not
  // current here (this worker did not make its last update): 8 bytes an expert.
  std::vector<int64_t> counts_;
  std::vector<uint8_t> count_current_;
  std::map<Expert, size_t> count_index_;
  // The running update's: its queued writes, the slots pinned for them, each batch's
  // writes in flight (kBatches) and each batch's payloads landed (its segment free).
  PutQueue queue_;
  std::vector<Expert> held_;
  std::vector<std::shared_future<absl::Status>> flushes_;
  std::vector<std::shared_future<absl::Status>> landed_;
  // The training thread's: every scratch segment is free again (the last launched
  // update's payloads have all landed), and the early fetch of the next step's first
  // batches' moments with the experts that step updates, handed to its Launch.
  std::shared_future<absl::Status> segments_free_;
  std::future<absl::Status> early_moments_;
  std::vector<Expert> early_used_;
  // The threads updates, fetchers and flushes run on; last: its destructor waits for
  // them before anything they use goes.
  TaskThreads tasks_;
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_EXPERT_UPDATER_H_
