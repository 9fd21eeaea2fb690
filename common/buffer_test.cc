#include "common/buffer.h"

#include <cstdint>
#include <utility>

#include "common/tensor.h"
#include "gtest/gtest.h"

namespace pith {
namespace {

TEST(BufferTest, AllocatesAlignedZeroedMemory) {
  absl::StatusOr<Buffer> b = Buffer::Allocate(1000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % Buffer::kAlignment, 0u);
  for (uint8_t v : b->span()) ASSERT_EQ(v, 0);
}

TEST(BufferTest, MoveTransfersOwnership) {
  Buffer a = *Buffer::Allocate(64);
  a.data()[3] = 7;
  Buffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data()[3], 7);
  Buffer c;
  c = std::move(b);
  EXPECT_EQ(c.data()[3], 7);
}

TEST(BufferTest, EmptyAndHugeAllocations) {
  absl::StatusOr<Buffer> empty = Buffer::Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  absl::StatusOr<Buffer> huge = Buffer::Allocate(SIZE_MAX - 8);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(TensorTest, ZerosAndCopy) {
  absl::StatusOr<Tensor> t = Tensor::Zeros(DType::kF32, {3, 4});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->numel(), 12);
  EXPECT_EQ(t->nbytes(), 48u);
  t->data<float>()[5] = 2.5f;
  absl::StatusOr<Tensor> copy = Tensor::CopyOf(t->view());
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ(copy->data<float>()[5], 2.5f);
  EXPECT_EQ(copy->shape(), (std::vector<int64_t>{3, 4}));
}

TEST(TensorTest, RejectsBadShapes) {
  EXPECT_EQ(Tensor::Zeros(DType::kF32, {2, -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor::Zeros(DType::kF64, {int64_t{1} << 40, int64_t{1} << 30}).status().code(),
            absl::StatusCode::kInvalidArgument);
  TensorView short_view{DType::kF32, {4}, {}};
  EXPECT_EQ(Tensor::CopyOf(short_view).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType d : {DType::kBool, DType::kU8, DType::kI8, DType::kF8E5M2, DType::kF8E4M3, DType::kI16,
                  DType::kU16, DType::kF16, DType::kBF16, DType::kI32, DType::kU32, DType::kF32,
                  DType::kF64, DType::kI64, DType::kU64}) {
    absl::StatusOr<DType> back = DTypeFromName(DTypeName(d));
    ASSERT_TRUE(back.ok()) << DTypeName(d);
    EXPECT_EQ(*back, d);
  }
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_FALSE(DTypeFromName("F128").ok());
}

}  // namespace
}  // namespace pith
