// Tensor: a dtype, a shape and bytes. `Tensor` owns its Buffer; `TensorView` borrows.
// Data is row-major and little-endian, as in safetensors.
//
// Thread safety: plain values; concurrent reads are safe.
#ifndef PITH_COMMON_TENSOR_H_
#define PITH_COMMON_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/buffer.h"

namespace pith {

// The safetensors dtypes.
enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors spelling ("F32", "BF16", ...).
absl::string_view DTypeName(DType dtype);
// Parses a safetensors dtype name; INVALID_ARGUMENT for an unknown one.
absl::StatusOr<DType> DTypeFromName(absl::string_view name);

// Elements in `shape`; INVALID_ARGUMENT for a negative dimension or when the count or its
// size in bytes of `dtype` would overflow 2^62.
absl::StatusOr<int64_t> CheckedNumel(absl::Span<const int64_t> shape, DType dtype);

// "[2, 3]".
std::string ShapeString(absl::Span<const int64_t> shape);

// A borrowed tensor. The bytes must outlive the view.
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> bytes;

  int64_t numel() const;
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
};

// An owning tensor in an aligned Buffer.
class Tensor {
 public:
  Tensor() = default;

  // A zero-filled tensor. INVALID_ARGUMENT for a bad shape, RESOURCE_EXHAUSTED when the
  // memory is not there.
  static absl::StatusOr<Tensor> Zeros(DType dtype, std::vector<int64_t> shape);
  // A copy of `view`.
  static absl::StatusOr<Tensor> CopyOf(const TensorView& view);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return buffer_.size(); }

  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(buffer_.data());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(buffer_.data());
  }
  absl::Span<uint8_t> bytes() { return buffer_.span(); }
  absl::Span<const uint8_t> bytes() const { return buffer_.span(); }

  TensorView view() const { return TensorView{dtype_, shape_, buffer_.span()}; }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  Buffer buffer_;
};

}  // namespace pith

#endif  // PITH_COMMON_TENSOR_H_
