#include "worker/compute/backend.h"

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

}  // namespace pith::compute
