// The device group of a job run (DESIGN §2): the collective its GPU workers sum their
// dense gradients over (NCCL on CUDA) instead of the peer group's host copies.
//
// Thread safety: JoinDeviceGroup runs on the training thread.
#ifndef PITH_WORKER_RUNTIME_DEVICE_GROUP_H_
#define PITH_WORKER_RUNTIME_DEVICE_GROUP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/compute/backend.h"
#include "worker/runtime/peer_group.h"

namespace pith::runtime {

// How long a rank waits for the others to join the device group.
inline constexpr absl::Duration kDeviceGroupTimeout = absl::Seconds(60);

// Joins the run's device group: rank 0 makes its id, `peers` carries it, every rank joins
// (at most `timeout`) and says whether it did. Null, on every rank alike, when the group
// has one rank, the backend has no device group, or some rank could not join (two
// workers on one GPU, which NCCL refuses): the dense sums then go through `peers`, and
// the reason is logged. Errors are the peer group's own only.
absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> JoinDeviceGroup(compute::Backend& backend,
                                                                      PeerGroup& peers,
                                                                      absl::Duration timeout);

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_DEVICE_GROUP_H_
