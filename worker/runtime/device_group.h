// The device group of a job run (DESIGN §2): the collective its GPU workers sum their
// dense gradients over and move their token rows over (NCCL on CUDA), instead of the
// peer group's host copies.
//
// Thread safety: JoinDeviceGroup runs on the training thread; DeviceGroupSlot says.
#ifndef PITH_WORKER_RUNTIME_DEVICE_GROUP_H_
#define PITH_WORKER_RUNTIME_DEVICE_GROUP_H_

#include <atomic>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "worker/compute/backend.h"
#include "worker/runtime/dense_mirror.h"
#include "worker/runtime/peer_group.h"

namespace pith::runtime {

// How long a rank waits for the others to join the device group.
inline constexpr absl::Duration kDeviceGroupTimeout = absl::Seconds(60);

// Joins the run's device group: rank 0 makes its id, `peers` carries it, every rank joins
// (at most `timeout`) and says whether it did. Null, on every rank alike, when the group
// has one rank, the backend has no device group, or some rank could not join (two
// workers on one GPU, which NCCL refuses, or a join `abandon` ended): the dense sums then
// go through `peers`, and the reason is logged. Errors are the peer group's own only. A rank whose
// backend reads host memory returns at once, without a word to the others: the coordinator never
// puts workers of two backend kinds in one job.
absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> JoinDeviceGroup(
    compute::Backend& backend, PeerGroup& peers, absl::Duration timeout,
    const std::atomic<bool>& abandon);

// A job run's device group: joined at its setup and again for each placement adopted in
// place (a new attempt: an aborted NCCL communicator is never used again), while the
// step's abort watch may abort it from its own thread.
//
// Thread safety: Rejoin and SumDense on the training thread; Abort on any thread.
class DeviceGroupSlot {
 public:
  // Replaces the group held with a new join (JoinDeviceGroup).
  absl::Status Rejoin(compute::Backend& backend, PeerGroup& peers, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Aborts the group held, if any, or ends the join in progress (an aborted attempt's:
  // not after its timeout).
  void Abort() ABSL_LOCKS_EXCLUDED(mu_);
  // The group held (null: none), valid until the next Rejoin.
  compute::DeviceGroup* group() ABSL_LOCKS_EXCLUDED(mu_);
  // Sums the dense gradients (`n` floats of backend memory at `grads`) on the group, or
  // without one through `dense`'s host copies over `peers` (`tag`); counts the device sums
  // in `device_sums`.
  absl::Status SumDense(float* grads, int64_t n, DenseMirror& dense, PeerGroup& peers, uint64_t tag,
                        prometheus::Counter* device_sums) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::unique_ptr<compute::DeviceGroup> group_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> abandon_join_{false};  // cleared by Rejoin, set by Abort
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_DEVICE_GROUP_H_
