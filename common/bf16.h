// bf16 on the host, and the bf16 weights blob of an expert (DESIGN §2, precision).
//
// A bf16 job's stores keep each expert's fp32 master [w1 C*F | b1 F | w2 F*C | b2 C] (the
// `master` blob, with the AdamW moments) and, as the `weights` blob the workers fetch into
// their caches, its bf16 form: w1 and w2 rounded to bf16 (round-to-nearest-even), b1 and
// b2 fp32, each part 16-byte aligned, the padding zero:
//   [w1 bf16 C*F | pad | w2 bf16 F*C | pad | b1 fp32 F | pad | b2 fp32 C | pad]
// The products read exactly the bf16 values a standalone bf16 run rounds its fp32 weights
// to, and the biases stay fp32 as there, so the two compute the same numbers; the blob is a
// little over half the fp32 one's bytes (on the wire and in the cache).
//
// Header-only: the compute engine's GPU-only build uses it too.
// Thread safety: pure functions.
#ifndef PITH_COMMON_BF16_H_
#define PITH_COMMON_BF16_H_

#include <cstdint>
#include <cstring>

namespace pith {

// fp32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t RoundToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Where the parts of an expert's bf16 weights blob start, in bytes, and its size.
struct Bf16ExpertLayout {
  int64_t w1 = 0, w2 = 0, b1 = 0, b2 = 0, bytes = 0;

  Bf16ExpertLayout(int64_t channels, int64_t hidden) {
    const auto align = [](int64_t x) { return (x + 15) / 16 * 16; };
    w2 = align(2 * channels * hidden);
    b1 = align(w2 + 2 * hidden * channels);
    b2 = align(b1 + 4 * hidden);
    bytes = align(b2 + 4 * channels);  // slots side by side keep every part aligned
  }
};

// Writes the bf16 weights blob of the fp32 expert `master` ([w1|b1|w2|b2]) into `blob`
// (Bf16ExpertLayout(channels, hidden).bytes).
inline void PackExpertBf16(const float* master, int64_t channels, int64_t hidden, void* blob) {
  const Bf16ExpertLayout at(channels, hidden);
  auto* out = static_cast<uint8_t*>(blob);
  std::memset(out, 0, static_cast<size_t>(at.bytes));
  const int64_t cf = channels * hidden;
  const float* w1 = master;
  const float* b1 = w1 + cf;
  const float* w2 = b1 + hidden;
  const float* b2 = w2 + cf;
  auto* w1_out = reinterpret_cast<uint16_t*>(out + at.w1);
  auto* w2_out = reinterpret_cast<uint16_t*>(out + at.w2);
  for (int64_t i = 0; i < cf; ++i) w1_out[i] = RoundToBf16(w1[i]);
  for (int64_t i = 0; i < cf; ++i) w2_out[i] = RoundToBf16(w2[i]);
  std::memcpy(out + at.b1, b1, sizeof(float) * static_cast<size_t>(hidden));
  std::memcpy(out + at.b2, b2, sizeof(float) * static_cast<size_t>(channels));
}

// The fp32 expert [w1|b1|w2|b2] a bf16 weights blob stands for (each weight widened).
inline void UnpackExpertBf16(const void* blob, int64_t channels, int64_t hidden, float* expert) {
  const Bf16ExpertLayout at(channels, hidden);
  const auto* in = static_cast<const uint8_t*>(blob);
  const int64_t cf = channels * hidden;
  float* w1 = expert;
  float* b1 = w1 + cf;
  float* w2 = b1 + hidden;
  float* b2 = w2 + cf;
  const auto* w1_in = reinterpret_cast<const uint16_t*>(in + at.w1);
  const auto* w2_in = reinterpret_cast<const uint16_t*>(in + at.w2);
  for (int64_t i = 0; i < cf; ++i) w1[i] = Bf16ToFloat(w1_in[i]);
  for (int64_t i = 0; i < cf; ++i) w2[i] = Bf16ToFloat(w2_in[i]);
  std::memcpy(b1, in + at.b1, sizeof(float) * static_cast<size_t>(hidden));
  std::memcpy(b2, in + at.b2, sizeof(float) * static_cast<size_t>(channels));
}

}  // namespace pith

#endif  // PITH_COMMON_BF16_H_
