// DenseMirror: host copies of a cluster worker's dense state (parameters, gradients and
// AdamW moments: the first `floats` of each arena) for a backend whose memory the host
// cannot reach (a GPU's). The stores' puts and fetches and the peer group's all-reduce
// work on host memory; on a host-addressable backend (the CPU's) every method hands back
// the backend's own memory and copies nothing.
//
// Thread safety: the training thread's. A put queued from Host() reads the copy until the
// step's writes end (JobRun::Finish), which is before the next Host() of the same kind
// rewrites it.
#ifndef PITH_WORKER_RUNTIME_DENSE_MIRROR_H_
#define PITH_WORKER_RUNTIME_DENSE_MIRROR_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"
#include "worker/runtime/peer_group.h"

namespace pith::runtime {

class DenseMirror {
 public:
  enum Kind { kParams, kGrads, kMomentM, kMomentV, kKinds };

  DenseMirror(compute::Backend* backend, int64_t floats)
      : backend_(backend), floats_(floats), on_(!backend->host_addressable()) {}

  // Whether copies are made (the backend's memory is not the host's).
  bool on() const { return on_; }
  // The dense floats at `dev` (backend memory), readable here: `dev` itself, or `kind`'s
  // copy, refreshed now.
  absl::StatusOr<const float*> Host(Kind kind, const float* dev);
  // Where a fetch of `kind`'s dense floats for `dev` lands: `dev` itself, or `kind`'s copy,
  // which Upload then moves to `dev`.
  float* Landing(Kind kind, float* dev);
  absl::Status Upload(Kind kind, float* dev);
  // Sums the dense gradients at `dev` across `peers` (`tag` as PeerGroup::AllReduceSum's).
  absl::Status AllReduceSum(PeerGroup& peers, float* dev, uint64_t tag);

 private:
  std::vector<float>& Copy(Kind kind);

  compute::Backend* backend_;
  int64_t floats_;
  bool on_;
  std::array<std::vector<float>, kKinds> copies_;  // sized on first use
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_DENSE_MIRROR_H_
