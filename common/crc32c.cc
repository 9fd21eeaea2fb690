#include "common/crc32c.h"

#include <immintrin.h>

#include <array>
#include <cstring>

namespace pith {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // reflected Castagnoli polynomial
constexpr size_t kFoldMinBytes = 256;   // shorter inputs take the crc32 instruction alone
constexpr size_t kWideMinBytes = 1024;  // and shorter than this the 128-bit folding

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

// x^n mod P as a 64-bit operand of a reflected carry-less multiply: degree d at bit 63 - d.
constexpr uint64_t FoldConstant(int n) {
  uint64_t r = 1;  // normal form: degree d at bit d
  for (int i = 0; i < n; ++i) {
    r <<= 1;
    if (r & (uint64_t{1} << 32)) r ^= 0x11edc6f41;  // the Castagnoli polynomial
  }
  uint64_t reflected = 0;
  for (int d = 0; d < 32; ++d) {
    if (r & (uint64_t{1} << d)) reflected |= uint64_t{1} << (63 - d);
  }
  return reflected;
}

// Folding by carry-less multiplication (Gopal et al., "Fast CRC computation for generic
// polynomials using PCLMULQDQ"), for CPUs whose crc32 instruction is slow (AMD's issue one
// every three cycles; there the three streams above reach ~5 GB/s, this ~3x that). A 16-byte
// chunk X followed by D bits of message is congruent to X.lo * x^(D+64) + X.hi * x^D; a
// reflected multiply adds one factor x, hence the constants x^(D+63) and x^(D-1). Four
// chunks fold 64 bytes ahead at a time, then into one; the crc32 instruction reduces the
// last 16 bytes (its value with initial 0 is that chunk * x^32 mod P, the CRC).
__attribute__((target("sse4.2,pclmul"))) inline __m128i Load(const uint8_t* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}
// x.lo * k.lo + x.hi * k.hi (carry-less).
__attribute__((target("sse4.2,pclmul"))) inline __m128i Fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

// The last 64 bytes folded so far as four chunks (x0 first), the rest of the input at p.
__attribute__((target("sse4.2,pclmul"))) uint32_t FoldTail(__m128i x0, __m128i x1, __m128i x2,
                                                           __m128i x3, const uint8_t* p, size_t n) {
  static constexpr uint64_t kX575 = FoldConstant(575), kX511 = FoldConstant(511);
  static constexpr uint64_t kX191 = FoldConstant(191), kX127 = FoldConstant(127);
  const __m128i k512 = _mm_set_epi64x(static_cast<int64_t>(kX511), static_cast<int64_t>(kX575));
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(kX127), static_cast<int64_t>(kX191));
  for (; n >= 64; p += 64, n -= 64) {
    x0 = _mm_xor_si128(Fold(x0, k512), Load(p));
    x1 = _mm_xor_si128(Fold(x1, k512), Load(p + 16));
    x2 = _mm_xor_si128(Fold(x2, k512), Load(p + 32));
    x3 = _mm_xor_si128(Fold(x3, k512), Load(p + 48));
  }
  __m128i x = _mm_xor_si128(Fold(x0, k128), x1);
  x = _mm_xor_si128(Fold(x, k128), x2);
  x = _mm_xor_si128(Fold(x, k128), x3);
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(Fold(x, k128), Load(p));
  uint64_t c = __builtin_ia32_crc32di(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = __builtin_ia32_crc32di(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  return Hardware(p, n, static_cast<uint32_t>(c));
}

__attribute__((target("sse4.2,pclmul"))) uint32_t Folded(const uint8_t* p, size_t n, uint32_t crc) {
  const __m128i x0 = _mm_xor_si128(Load(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  return FoldTail(x0, Load(p + 16), Load(p + 32), Load(p + 48), p + 64, n - 64);
}

// The same folding four times as wide (VPCLMULQDQ on 512-bit registers, where the CPU has
// it): four registers of four 16-byte lanes fold 256 bytes 2048 bits ahead a step, then
// into one register 512 bits apart, whose lanes go on as FoldTail's four chunks.
#define PITH_CRC_WIDE __attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq")))
PITH_CRC_WIDE inline __m512i Fold512(__m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                          _mm512_clmulepi64_epi128(x, k, 0x11));
}
PITH_CRC_WIDE inline __m512i Load512(const uint8_t* q) { return _mm512_loadu_si512(q); }
PITH_CRC_WIDE inline __m512i EveryLane(uint64_t lo, uint64_t hi) {
  const auto l = static_cast<int64_t>(lo), h = static_cast<int64_t>(hi);
  return _mm512_set_epi64(h, l, h, l, h, l, h, l);
}

PITH_CRC_WIDE uint32_t FoldedWide(const uint8_t* p, size_t n, uint32_t crc) {
  static constexpr uint64_t kX2111 = FoldConstant(2111), kX2047 = FoldConstant(2047);
  static constexpr uint64_t kX575 = FoldConstant(575), kX511 = FoldConstant(511);
  const __m512i k2048 = EveryLane(kX2111, kX2047), k512 = EveryLane(kX575, kX511);
  const __m512i first =
      _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128(static_cast<int>(crc)), 0);
  __m512i z0 = _mm512_xor_si512(Load512(p), first);
  __m512i z1 = Load512(p + 64), z2 = Load512(p + 128), z3 = Load512(p + 192);
  p += 256;
  n -= 256;
  for (; n >= 256; p += 256, n -= 256) {
    z0 = _mm512_xor_si512(Fold512(z0, k2048), Load512(p));
    z1 = _mm512_xor_si512(Fold512(z1, k2048), Load512(p + 64));
    z2 = _mm512_xor_si512(Fold512(z2, k2048), Load512(p + 128));
    z3 = _mm512_xor_si512(Fold512(z3, k2048), Load512(p + 192));
  }
  __m512i z = _mm512_xor_si512(Fold512(z0, k512), z1);
  z = _mm512_xor_si512(Fold512(z, k512), z2);
  z = _mm512_xor_si512(Fold512(z, k512), z3);
  // Through memory: GCC 12 flags the lane extracts' undefined source register.
  alignas(64) uint8_t lanes[64];
  _mm512_store_si512(lanes, z);
  return FoldTail(Load(lanes), Load(lanes + 16), Load(lanes + 32), Load(lanes + 48), p, n);
}
#undef PITH_CRC_WIDE

}  // namespace

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  static const bool hw = __builtin_cpu_supports("sse4.2");
  static const bool fold = hw && __builtin_cpu_supports("pclmul");
  static const bool wide =
      fold && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  if (wide && size >= kWideMinBytes) {
    crc = FoldedWide(p, size, crc);
  } else if (fold && size >= kFoldMinBytes) {
    crc = Folded(p, size, crc);
  } else {
    crc = hw ? Hardware(p, size, crc) : Software(p, size, crc);
  }
  return ~crc;
}

}  // namespace pith
