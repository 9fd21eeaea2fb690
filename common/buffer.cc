#include "common/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pith {

absl::StatusOr<Buffer> Buffer::Allocate(size_t size, Init init) {
  if (size == 0) return Buffer();
  if (size > SIZE_MAX - kAlignment) {
    return absl::ResourceExhaustedError(absl::StrCat("buffer of ", size, " bytes is too large"));
  }
  // aligned_alloc wants the size to be a multiple of the alignment.
  const size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size, " bytes"));
  }
  if (init == Init::kZero) std::memset(p, 0, rounded);
  return Buffer(static_cast<uint8_t*>(p), size);
}

absl::StatusOr<Buffer> Buffer::CopyOf(absl::Span<const uint8_t> bytes) {
  absl::StatusOr<Buffer> buffer = Allocate(bytes.size(), Init::kUninitialized);
  if (buffer.ok() && !bytes.empty()) std::memcpy(buffer->data(), bytes.data(), bytes.size());
  return buffer;
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Buffer::~Buffer() { std::free(data_); }

}  // namespace pith
