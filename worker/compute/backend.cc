#include "worker/compute/backend.h"

#include "absl/strings/str_cat.h"

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

absl::Status Backend::SetComputeDtype(ComputeDtype dtype) {
  if (dtype == ComputeDtype::kFp32) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model.compute_dtype ", ComputeDtypeName(dtype), ": the ", name(),
                   " backend computes in fp32 only (bf16 needs the CUDA backend)"));
}

}  // namespace pith::compute
