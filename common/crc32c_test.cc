// Crc32c: the standard check value, and the hardware paths (carry-less folding of 256 bytes
// at a time on 512-bit registers from 1 KiB where the CPU has VPCLMULQDQ, of 64 bytes from
// 256 bytes, three interleaved crc32 streams otherwise) against a
// bit-at-a-time reference over lengths and offsets around their block boundaries, in one
// call and in pieces.
#include "common/crc32c.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace pith {
namespace {

uint32_t Reference(const uint8_t* p, size_t n, uint32_t crc = 0) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82f63b78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32cTest, CheckValue) {
  const char* s = "123456789";
  EXPECT_EQ(Crc32c(s, 9), 0xe3069283u);
  EXPECT_EQ(Crc32c(s, 0), 0u);
}

TEST(Crc32cTest, LongInputsMatchTheReference) {
  std::vector<uint8_t> data(3 * 8192 * 2 + 3 * 256 * 3 + 100);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t offset : {0, 1, 3, 7}) {
    for (size_t n : {0,
                     1,
                     8,
                     255,
                     256,
                     257,
                     271,
                     272,
                     319,
                     320,
                     321,
                     767,
                     768,
                     769,
                     1023,
                     1024,
                     1025,
                     1279,
                     1280,
                     1295,
                     1343,
                     2047,
                     2048,
                     4096 + 17,
                     24575,
                     24576,
                     24577,
                     49152 + 768 + 5,
                     static_cast<int>(data.size()) - 7}) {
      const uint8_t* p = data.data() + offset;
      ASSERT_EQ(Crc32c(p, n), Reference(p, n)) << "offset " << offset << " n " << n;
      const size_t half = n / 3;
      EXPECT_EQ(Crc32c(p + half, n - half, Crc32c(p, half)), Reference(p, n)) << n;
    }
  }
}

}  // namespace
}  // namespace pith
