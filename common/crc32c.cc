#include "common/crc32c.h"

#include <array>
#include <cstring>

namespace pith {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // reflected Castagnoli polynomial

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t Software(const uint8_t* p, size_t n, uint32_t crc) {
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

// The operator that runs a CRC register through `len` zero bytes (a power of two), as
// four byte-indexed tables: the CRC of A || B is Shift(crc(A), |B|) ^ crc_from_zero(B).
// (After Mark Adler's crc32c.c.)
class Zeros {
 public:
  explicit Zeros(size_t len) {
    uint32_t op[32];
    Operator(op, len);
    for (uint32_t n = 0; n < 256; ++n) {
      for (int b = 0; b < 4; ++b) table_[b][n] = Times(op, n << (8 * b));
    }
  }
  uint32_t Shift(uint32_t crc) const {
    return table_[0][crc & 0xff] ^ table_[1][(crc >> 8) & 0xff] ^ table_[2][(crc >> 16) & 0xff] ^
           table_[3][crc >> 24];
  }

 private:
  static uint32_t Times(const uint32_t* mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec != 0; vec >>= 1, ++mat) {
      if (vec & 1) sum ^= *mat;
    }
    return sum;
  }
  static void Square(uint32_t* square, const uint32_t* mat) {
    for (int n = 0; n < 32; ++n) square[n] = Times(mat, mat[n]);
  }
  static void Operator(uint32_t* even, size_t len) {
    uint32_t odd[32];
    odd[0] = kPoly;  // one zero bit
    for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
    Square(even, odd);  // two zero bits
    Square(odd, even);  // four
    while (true) {
      Square(even, odd);  // eight (one byte), then each pass doubles
      len >>= 1;
      if (len == 0) return;
      Square(odd, even);
      len >>= 1;
      if (len == 0) break;
    }
    std::memcpy(even, odd, sizeof(odd));
  }

  uint32_t table_[4][256];
};

// Three interleaved streams of `block` bytes each: the crc32 instruction's latency is
// three cycles and its throughput one, so one stream runs at a third of the speed.
template <size_t kBlock>
__attribute__((target("sse4.2"))) uint64_t ThreeWay(const uint8_t*& p, size_t& n, uint64_t c0) {
  static const Zeros zeros(kBlock);
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p + kBlock + i, 8);
      std::memcpy(&v2, p + 2 * kBlock + i, 8);
      c0 = __builtin_ia32_crc32di(c0, v0);
      c1 = __builtin_ia32_crc32di(c1, v1);
      c2 = __builtin_ia32_crc32di(c2, v2);
    }
    c0 = zeros.Shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = zeros.Shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t Hardware(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  c = ThreeWay<8192>(p, n, c);
  c = ThreeWay<256>(p, n, c);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  static const bool hw = __builtin_cpu_supports("sse4.2");
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  crc = hw ? Hardware(p, size, crc) : Software(p, size, crc);
  return ~crc;
}

}  // namespace pith
