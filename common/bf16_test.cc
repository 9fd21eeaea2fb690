// bf16 rounding on the host and the bf16 weights blob of an expert.
#include "common/bf16.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace pith {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(RoundToBf16(1.0f), 0x3f80);
  EXPECT_EQ(RoundToBf16(-2.0f), 0xc000);
  EXPECT_EQ(RoundToBf16(FromBits(0x3f808000)), 0x3f80);  // halfway: to the even one below
  EXPECT_EQ(RoundToBf16(FromBits(0x3f818000)), 0x3f82);  // halfway: to the even one above
  EXPECT_EQ(RoundToBf16(FromBits(0x3f808001)), 0x3f81);  // past halfway: up
  EXPECT_EQ(RoundToBf16(FromBits(0x3f807fff)), 0x3f80);  // short of it: down
  EXPECT_EQ(RoundToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(RoundToBf16(FromBits(0x7f7fffff)), 0x7f80);  // the largest float overflows
  EXPECT_TRUE(std::isnan(Bf16ToFloat(RoundToBf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(RoundToBf16(FromBits(0x7f800001)))));  // not inf
  for (float f : {0.0f, -0.0f, 1.5f, -3.25f, std::ldexp(1.0f, -100), 65536.0f}) {
    EXPECT_EQ(Bf16ToFloat(RoundToBf16(f)), f) << f;  // exactly representable
  }
}

TEST(Bf16Test, AnExpertBlobHoldsRoundedWeightsAndExactBiases) {
  const int64_t C = 6, F = 5;  // odd sizes: the parts need their padding
  const Bf16ExpertLayout at(C, F);
  EXPECT_EQ(at.w1, 0);
  for (int64_t offset : {at.w2, at.b1, at.b2}) EXPECT_EQ(offset % 16, 0);
  EXPECT_GE(at.w2, 2 * C * F);
  EXPECT_EQ(at.bytes % 16, 0);
  EXPECT_GE(at.bytes, at.b2 + 4 * C);
  EXPECT_LT(at.bytes, at.b2 + 4 * C + 16);
  std::vector<float> master(2 * C * F + F + C);
  for (size_t i = 0; i < master.size(); ++i) master[i] = 0.1234567f * (i + 1) - 1.0f;
  std::vector<uint8_t> blob(at.bytes, 0xab);
  PackExpertBf16(master.data(), C, F, blob.data());
  for (int64_t i = 2 * C * F; i < at.w2; ++i) EXPECT_EQ(blob[i], 0) << "padding at " << i;
  std::vector<float> back(master.size());
  UnpackExpertBf16(blob.data(), C, F, back.data());
  const int64_t cf = C * F;
  for (int64_t i = 0; i < cf; ++i) {
    EXPECT_EQ(back[i], Bf16ToFloat(RoundToBf16(master[i])));                    // w1
    EXPECT_EQ(back[cf + F + i], Bf16ToFloat(RoundToBf16(master[cf + F + i])));  // w2
    EXPECT_NE(back[i], master[i]);                                              // rounded
  }
  for (int64_t i = 0; i < F; ++i) EXPECT_EQ(back[cf + i], master[cf + i]);                  // b1
  for (int64_t i = 0; i < C; ++i) EXPECT_EQ(back[2 * cf + F + i], master[2 * cf + F + i]);  // b2
  // A little over half the fp32 blob's bytes at a real shape.
  const Bf16ExpertLayout qwen(2048, 768);
  EXPECT_LT(qwen.bytes, (2 * 2048 * 768 + 2048 + 768) * 4 * 51 / 100);
}

}  // namespace
}  // namespace pith
