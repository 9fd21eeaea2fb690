#include "worker/runtime/dense_mirror.h"

#include "common/status.h"

namespace pith::runtime {

std::vector<float>& DenseMirror::Copy(Kind kind) {
  std::vector<float>& copy = copies_[kind];
  copy.resize(floats_);
  return copy;
}

absl::StatusOr<const float*> DenseMirror::Host(Kind kind, const float* dev) {
  return compute::ReadableOnHost(*backend_, dev, floats_, copies_[kind]);
}

float* DenseMirror::Landing(Kind kind, float* dev) { return on_ ? Copy(kind).data() : dev; }

absl::Status DenseMirror::Upload(Kind kind, float* dev) {
  if (!on_) return absl::OkStatus();
  return backend_->CopyToDevice(dev, Copy(kind).data(), floats_ * sizeof(float));
}

absl::Status DenseMirror::AllReduceSum(PeerGroup& peers, float* dev, uint64_t tag) {
  if (!on_) return peers.AllReduceSum(dev, floats_, tag);
  std::vector<float>& copy = Copy(kGrads);
  RETURN_IF_ERROR(backend_->CopyToHost(copy.data(), dev, floats_ * sizeof(float)));
  RETURN_IF_ERROR(peers.AllReduceSum(copy.data(), floats_, tag));
  return backend_->CopyToDevice(dev, copy.data(), floats_ * sizeof(float));
}

}  // namespace pith::runtime
