#include "common/tensor.h"

#include <array>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace pith {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {DType::kBool, "BOOL", 1},
    {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kI16, "I16", 2},
    {DType::kU16, "U16", 2},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI32, "I32", 4},
    {DType::kU32, "U32", 4},
    {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},
    {DType::kI64, "I64", 8},
    {DType::kU64, "U64", 8},
}};

constexpr int64_t kMaxBytes = int64_t{1} << 62;

}  // namespace

size_t DTypeSize(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].size; }

absl::string_view DTypeName(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].name; }

absl::StatusOr<DType> DTypeFromName(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

absl::StatusOr<int64_t> CheckedNumel(absl::Span<const int64_t> shape, DType dtype) {
  const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension in shape ", ShapeString(shape)));
    }
    if (dim != 0 && numel > kMaxBytes / elem / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " is too large"));
    }
    numel *= dim;
  }
  return numel;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<Tensor> Tensor::Zeros(DType dtype, std::vector<int64_t> shape) {
  ASSIGN_OR_RETURN(int64_t numel, CheckedNumel(shape, dtype));
  Tensor t;
  ASSIGN_OR_RETURN(t.buffer_, Buffer::Allocate(static_cast<size_t>(numel) * DTypeSize(dtype)));
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.numel_ = numel;
  return t;
}

absl::StatusOr<Tensor> Tensor::CopyOf(const TensorView& view) {
  ASSIGN_OR_RETURN(int64_t numel, CheckedNumel(view.shape, view.dtype));
  if (static_cast<size_t>(numel) * DTypeSize(view.dtype) != view.bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor of shape ", ShapeString(view.shape), " and dtype ", DTypeName(view.dtype),
        " needs ", numel * DTypeSize(view.dtype), " bytes, got ", view.bytes.size()));
  }
  Tensor t;
  ASSIGN_OR_RETURN(t.buffer_, Buffer::CopyOf(view.bytes));
  t.dtype_ = view.dtype;
  t.shape_ = view.shape;
  t.numel_ = numel;
  return t;
}

}  // namespace pith
