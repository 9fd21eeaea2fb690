#include "worker/compute/backend.h"

#include "absl/strings/str_cat.h"
#include "common/bf16.h"

namespace pith::compute {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (owner_ != nullptr && ptr_ != nullptr) owner_->Free(ptr_, bytes_);
    owner_ = std::exchange(o.owner_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (owner_ != nullptr && ptr_ != nullptr) owner_->Free(ptr_, bytes_);
}

ExpertWeights ExpertWeightsAt(const void* blob, bool bf16, int channels, int hidden) {
  const int64_t cf = int64_t{channels} * hidden;
  if (bf16) {
    const Bf16ExpertLayout at(channels, hidden);
    const auto* base = static_cast<const uint8_t*>(blob);
    ExpertWeights w{nullptr, reinterpret_cast<const float*>(base + at.b1), nullptr,
                    reinterpret_cast<const float*>(base + at.b2)};
    w.w1_bf16 = reinterpret_cast<const uint16_t*>(base + at.w1);
    w.w2_bf16 = reinterpret_cast<const uint16_t*>(base + at.w2);
    return w;
  }
  const auto* w = static_cast<const float*>(blob);
  return {w, w + cf, w + cf + hidden, w + 2 * cf + hidden};
}

absl::StatusOr<std::unique_ptr<SlotMirror>> Backend::MakeSlotMirror(size_t, int, void*, size_t) {
  return absl::UnimplementedError(
      absl::StrCat("the ", name(), " backend reads host memory: it needs no slot mirror"));
}

absl::StatusOr<std::string> Backend::NewGroupId() {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no device group"));
}

absl::StatusOr<std::unique_ptr<DeviceGroup>> Backend::JoinGroup(const std::string&, int, int,
                                                                absl::Duration,
                                                                const std::atomic<bool>&) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no device group"));
}

absl::Status Backend::SetComputeDtype(ComputeDtype dtype) {
  if (dtype == ComputeDtype::kFp32) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model.compute_dtype ", ComputeDtypeName(dtype), ": the ", name(),
                   " backend computes in fp32 only (bf16 needs the CUDA backend)"));
}

}  // namespace pith::compute
