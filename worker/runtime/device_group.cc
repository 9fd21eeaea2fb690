#include "worker/runtime/device_group.h"

#include <string>
#include <utility>

#include "common/status.h"
#include "glog/logging.h"
#include "worker/runtime/peer_channels.h"

namespace pith::runtime {

absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> JoinDeviceGroup(
    compute::Backend& backend, PeerGroup& peers, absl::Duration timeout,
    const std::atomic<bool>& abandon) {
  const int world = peers.world(), rank = peers.rank();
  if (world < 2 || backend.host_addressable()) return nullptr;
  std::string id;  // empty: rank 0 has no group to offer
  if (rank == 0) {
    absl::StatusOr<std::string> made = backend.NewGroupId();
    if (made.ok()) {
      id = *made;
    } else {
      LOG(WARNING) << "no device group: " << made.status();
    }
  }
  ASSIGN_OR_RETURN(id, peers.Broadcast(0, channels::DeviceGroupId(), std::move(id)));
  std::unique_ptr<compute::DeviceGroup> group;
  if (!id.empty()) {
    absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> joined =
        backend.JoinGroup(id, rank, world, timeout, abandon);
    if (joined.ok()) {
      group = std::move(*joined);
    } else {
      LOG(WARNING) << "rank " << rank << " could not join the device group: " << joined.status();
    }
  }
  double joined = group != nullptr ? 1 : 0;
  RETURN_IF_ERROR(peers.AllReduceSum(&joined, 1, channels::DeviceGroupJoined()));
  if (joined < world) {
    if (!id.empty()) {
      LOG(WARNING) << static_cast<int>(joined) << " of " << world
                   << " ranks joined the device group: the dense gradients and the token "
                      "rows go through the peer group";
    }
    return nullptr;
  }
  LOG(INFO) << "the dense gradients and the token rows go over the device group (" << world
            << " ranks)";
  return group;
}

absl::Status DeviceGroupSlot::Rejoin(compute::Backend& backend, PeerGroup& peers,
                                     absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    group_.reset();
    // An abort before this point was the previous attempt's (this one's own ends its peer
    // group's exchanges below as well).
    abandon_join_ = false;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<compute::DeviceGroup> group,
                   JoinDeviceGroup(backend, peers, timeout, abandon_join_));
  absl::MutexLock lock(&mu_);
  group_ = std::move(group);
  return absl::OkStatus();
}

void DeviceGroupSlot::Abort() {
  absl::MutexLock lock(&mu_);
  abandon_join_ = true;
  if (group_ != nullptr) group_->RequestAbort();
}

compute::DeviceGroup* DeviceGroupSlot::group() {
  absl::MutexLock lock(&mu_);
  return group_.get();  // replaced on this thread only
}

absl::Status DeviceGroupSlot::SumDense(float* grads, int64_t n, DenseMirror& dense,
                                       PeerGroup& peers, uint64_t tag,
                                       prometheus::Counter* device_sums) {
  compute::DeviceGroup* const group = this->group();
  if (group == nullptr) return dense.AllReduceSum(peers, grads, tag);
  device_sums->Increment();
  return group->AllReduceSum(grads, static_cast<size_t>(n), kPeerReceiveTimeout);
}

}  // namespace pith::runtime
