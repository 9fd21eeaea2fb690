// GradPool: the gradients of the experts a worker computes, in a fixed number of
// buffers (DESIGN §6, memory). The backward opens an expert's buffer (zeroed), accumulates
// its gradient over every row, and closes it; the gradient then waits for the replica
// reduce, the global gradient norm and the expert's update, in its buffer or, once the
// backward needs that buffer for a later expert, in an unlinked scratch file (the page
// cache, then the disk; written again only when changed since, never once applied). The
// norm clips every gradient, so none can be applied before the backward ends: what
// bounds a worker's memory is that the waiting ones need not be in it. Buffers are
// reused least recently used first. A scratch directory on tmpfs keeps the file in
// memory (a warning says so).
//
// Thread safety: thread-safe. One step's gradients at a time: Reset starts the next, once
// none is held.
#ifndef PITH_WORKER_RUNTIME_GRAD_POOL_H_
#define PITH_WORKER_RUNTIME_GRAD_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/buffer.h"
#include "common/file.h"

namespace pith::runtime {

class GradPool {
 public:
  using Expert = std::pair<int, int>;  // (layer, expert)

  // `buffers` (at least 2) buffers of `floats` floats; the scratch file in directory
  // `scratch_dir` (created only when a gradient first spills).
  static absl::StatusOr<std::unique_ptr<GradPool>> Create(int64_t floats, int buffers,
                                                          std::string scratch_dir);
  GradPool(const GradPool&) = delete;
  GradPool& operator=(const GradPool&) = delete;

  // Forgets every gradient (the step's have been applied or dropped).
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);
  // A zeroed buffer for x's gradient in this step, held until Close(x); a closed gradient
  // nobody holds goes to the scratch file to free one. FAILED_PRECONDITION when x is open
  // already or every buffer is held.
  absl::StatusOr<float*> Open(Expert x) ABSL_LOCKS_EXCLUDED(mu_);
  void Close(Expert x) ABSL_LOCKS_EXCLUDED(mu_);
  // What an Acquire does with the gradient. kRead: reads it (NOT_FOUND when x has none
  // this step). kUpdate: may change it; a zeroed one when x has none (an expert that got
  // no rows here, whose gradient is then a replica sum or zero).
  enum class Use { kRead, kUpdate };
  // x's gradient, held until Release(x): read back from the scratch file when it was
  // spilled.
  absl::StatusOr<float*> Acquire(Expert x, Use use = Use::kRead) ABSL_LOCKS_EXCLUDED(mu_);
  // With `drop`, the gradient is done with (sent, or applied): its buffer is free once
  // nobody holds it, and it is never written to the scratch file again.
  void Release(Expert x, bool drop = false) ABSL_LOCKS_EXCLUDED(mu_);
  bool Has(Expert x) const ABSL_LOCKS_EXCLUDED(mu_);

  int buffers() const { return buffer_count_; }
  // Bytes of the buffers (what the pool holds in memory, whatever is spilled).
  uint64_t bytes() const { return memory_.size(); }
  // Where the buffers are (a device's copies may page-lock the range).
  void* memory() { return memory_.data(); }
  struct Stats {
    uint64_t spills = 0;  // gradients written to the scratch file
    uint64_t loads = 0;   // and read back
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  GradPool(int64_t floats, Buffer memory, int buffers, std::string scratch_dir);
  struct Slot {
    Expert owner{-1, -1};
    bool used = false;
    int holds = 0;          // Open (until Close) and Acquire (until Release)
    uint64_t last_use = 0;  // clock_ at the last Close or Release
    bool dirty = true;      // differs from the scratch file's copy (or there is none)
    bool dropped = false;   // Release(drop): free once unheld
  };
  struct Grad {
    int slot = -1;            // its buffer, or -1 when it is in the scratch file only
    int64_t file_index = -1;  // its place in the scratch file, once it spilled
  };
  float* Data(int slot) { return reinterpret_cast<float*>(memory_.data()) + slot * floats_; }
  // A buffer for a gradient, spilling the least recently used unheld one when none is
  // free. Requires mu_.
  absl::StatusOr<int> TakeSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SpillLocked(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OpenFileLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A zeroed buffer for x, held once. Requires mu_.
  absl::StatusOr<float*> OpenLocked(Expert x) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t floats_;
  const int buffer_count_;
  Buffer memory_;  // buffer_count_ * floats_ floats
  const std::string scratch_dir_;
  mutable absl::Mutex mu_;
  std::vector<Slot> buffers_ ABSL_GUARDED_BY(mu_);
  std::map<Expert, Grad> grads_ ABSL_GUARDED_BY(mu_);  // this step's
  // Each expert's place in the scratch file, kept across steps (the file's size is the
  // experts that ever spilled: disk, not memory).
  std::map<Expert, int64_t> file_index_ ABSL_GUARDED_BY(mu_);
  UniqueFd file_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_GRAD_POOL_H_
