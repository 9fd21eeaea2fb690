// The wgmma kernel's shared-memory layout (wgmma_layout.h) against the PTX ISA's canonical
// layouts for 128-byte-swizzled bf16 operands, on the host: every element the loaders place
// is where the MMA, reading through the kernel's descriptor, looks for it. The canonical
// layouts, in the ISA's CuTe notation with T = 8 bf16 per 16 bytes, offsets in elements:
//   K-major:  Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T))
//   MN-major: Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
// The swizzle XORs address bits 4-6 with bits 7-9 of the whole shared-memory address, which
// is why a K-major k16 slice can start 32 bytes into an atom's rows. Needs no GPU.
#include "worker/cuda/wgmma_layout.h"

#include <set>

#include "gtest/gtest.h"

namespace pith::cuda::wgmma {
namespace {

// The byte the MMA reads for its operand's element (i along m or n, j along k, j < 16)
// through a descriptor whose start is `d.start` bytes into a 1024-byte-aligned stage.
int CanonicalByte(bool mn_major, const DescriptorParts& d, int i, int j) {
  int elements;
  if (mn_major) {  // i = i0 + T i1 + 8T i2, j = j0 + 8 j1
    elements = i % 64 + (i / 64) * (d.leading / 2) + (j % 8) * 64 + (j / 8) * (d.stride / 2);
  } else {  // i = i0 + 8 i1, j = j0 + T j1
    elements = (i % 8) * 64 + (i / 8) * (d.stride / 2) + j % 8 + (j / 8) * 8;
  }
  return Swizzle128(d.start + 2 * elements);
}

// Loader placements: each element once, inside the stage, whole 16-byte chunks in order
// (cp.async copies 8 consecutive elements of a stored row at a time).
TEST(WgmmaLayoutTest, EveryElementHasItsOwnByteAndChunksStayWhole) {
  for (bool mn_major : {false, true}) {
    SCOPED_TRACE(mn_major ? "MN-major" : "K-major");
    const int rows = 256;  // the widest operand tile (B of 128 x 256)
    std::set<int> seen;
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < kStageK; ++k) {
        const int at = mn_major ? MnMajorOffset(r, k) : KMajorOffset(r, k);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, rows * kStageK * 2);
        ASSERT_EQ(at % 2, 0);
        EXPECT_TRUE(seen.insert(at).second) << "row " << r << " k " << k << " shares byte " << at;
        // The chunk start and this element: 2 bytes per step along the stored row.
        const int along = mn_major ? r % 8 : k % 8;
        const int chunk = mn_major ? MnMajorOffset(r - along, k) : KMajorOffset(r, k - along);
        EXPECT_EQ(at, chunk + 2 * along) << "row " << r << " k " << k;
        EXPECT_EQ(chunk % 16, 0);
      }
    }
  }
}

// What the MMAs read: warpgroup w's 64 rows of A (first 64 w), each 128-column half h of B
// (first 128 h), every k16 slice; the instruction's operand element (i, j) must be the
// tile's element (first + i, 16 slice + j) as the loader placed it.
TEST(WgmmaLayoutTest, DescriptorsReadWhatTheLoadersWrote) {
  struct Operand {
    const char* name;
    int first, width;
  };
  for (bool mn_major : {false, true}) {
    for (const Operand& o : {Operand{"A, warpgroup 0", 0, 64}, Operand{"A, warpgroup 1", 64, 64},
                             Operand{"B, half 0", 0, 128}, Operand{"B, half 1", 128, 128}}) {
      for (int slice = 0; slice < kStageK / 16; ++slice) {
        SCOPED_TRACE(testing::Message()
                     << (mn_major ? "MN-major " : "K-major ") << o.name << ", slice " << slice);
        const DescriptorParts d = OperandDescriptor(mn_major, o.first, slice);
        int wrong = 0;
        for (int i = 0; i < o.width && wrong < 4; ++i) {
          for (int j = 0; j < 16 && wrong < 4; ++j) {
            const int row = o.first + i, k = slice * 16 + j;
            const int placed = mn_major ? MnMajorOffset(row, k) : KMajorOffset(row, k);
            const int read = CanonicalByte(mn_major, d, i, j);
            if (placed != read) {
              ADD_FAILURE() << "element (" << i << ", " << j << "): placed at " << placed
                            << ", read at " << read;
              ++wrong;
            }
          }
        }
      }
    }
  }
}

// The descriptor's fields, packed as the ISA's table says: bits 0-13 the start address,
// 16-29 the leading and 32-45 the stride byte offset (each >> 4), 49-51 the base offset
// (0: atoms on 1024-byte boundaries), 62-63 the swizzle mode (1: 128 bytes).
TEST(WgmmaLayoutTest, DescriptorFieldsArePackedAsTheIsaSays) {
  const DescriptorParts d = OperandDescriptor(true, 128, 3);
  const uint32_t address = 0x2400 + d.start;  // a stage 9 KiB into shared memory
  const uint64_t desc = Descriptor(address, d);
  EXPECT_EQ((desc & 0x3FFF) << 4, address);
  EXPECT_EQ(((desc >> 16) & 0x3FFF) << 4, static_cast<uint64_t>(d.leading));
  EXPECT_EQ(((desc >> 32) & 0x3FFF) << 4, static_cast<uint64_t>(d.stride));
  EXPECT_EQ((desc >> 49) & 7, 0u);
  EXPECT_EQ(desc >> 62, 1u);
  EXPECT_EQ(desc & ((uint64_t{3} << 14) | (uint64_t{3} << 30) | (uint64_t{7} << 46) |
                    (uint64_t{0x3FF} << 52)),
            0u)
      << "reserved bits set";
  // The largest offsets a 193 KiB stage ring needs fit the 14-bit fields.
  EXPECT_EQ(Descriptor(0x30000, d) & 0x3FFF, 0x3000u);
}

}  // namespace
}  // namespace pith::cuda::wgmma
