// Buffer: owning, aligned host memory. The unit every tensor, blob and cache slot in
// Pith is carved from.
//
// Thread safety: a Buffer is a plain value; concurrent reads are safe, anything else
// needs external synchronization.
#ifndef PITH_COMMON_BUFFER_H_
#define PITH_COMMON_BUFFER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pith {

class Buffer {
 public:
  // Alignment of every Buffer: a cache line, and enough for AVX-512 loads.
  static constexpr size_t kAlignment = 64;

  enum class Init { kZero, kUninitialized };

  // An empty buffer (data() is null, size() is 0).
  Buffer() = default;

  // Allocates `size` bytes aligned to kAlignment. RESOURCE_EXHAUSTED when the memory is
  // not there.
  static absl::StatusOr<Buffer> Allocate(size_t size, Init init = Init::kZero);

  // A copy of `bytes` in a new aligned buffer.
  static absl::StatusOr<Buffer> CopyOf(absl::Span<const uint8_t> bytes);

  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  absl::Span<uint8_t> span() { return {data_, size_}; }
  absl::Span<const uint8_t> span() const { return {data_, size_}; }

 private:
  Buffer(uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace pith

#endif  // PITH_COMMON_BUFFER_H_
