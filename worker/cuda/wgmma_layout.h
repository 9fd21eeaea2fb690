// Where the wgmma grouped kernel (cuda_wgmma.cu) puts each bf16 element of a pipeline stage
// in shared memory, and the matrix descriptors its MMAs read the stage through: plain
// arithmetic, callable from the kernel and from the host, so that wgmma_layout_test checks
// on any machine that both agree with the PTX ISA's canonical layouts.
//
// A stage holds k in [0, 64) of an operand: one 128-byte row of bf16. Both layouts are made
// of 1024-byte atoms of 8 rows of 128 bytes with the 128-byte swizzle: 16-byte chunk c of
// row r of an atom lies at chunk c ^ r (the hardware XORs address bits 4-6 with bits 7-9,
// so atoms start on 1024-byte boundaries).
//   K-major (A stored [m][k], B stored [n][k]): a row per m (or n), holding its 64 k; the
//     atom of rows [8a, 8a + 8) at byte 1024 a.
//   MN-major (A stored [k][m], B stored [k][n]): a row per k, holding 64 of m (or n); the
//     atom of columns [64b, 64b + 64) and k rows [8j, 8j + 8) at byte 1024 (8 b + j).
#ifndef PITH_WORKER_CUDA_WGMMA_LAYOUT_H_
#define PITH_WORKER_CUDA_WGMMA_LAYOUT_H_

#include <cstdint>

#ifdef __CUDACC__
#define PITH_HOST_DEVICE __host__ __device__
#else
#define PITH_HOST_DEVICE
#endif

namespace pith::cuda::wgmma {

inline constexpr int kStageK = 64;  // k per stage
inline constexpr int kAtom = 1024;  // bytes per swizzle atom
inline constexpr int kKGroups = kStageK / 8;

// The 128-byte swizzle of a byte offset from a 1024-byte boundary.
PITH_HOST_DEVICE constexpr int Swizzle128(int offset) {
  return offset ^ (((offset >> 7) & 7) << 4);
}

// The byte offset of element (row, k) in a K-major stage.
PITH_HOST_DEVICE constexpr int KMajorOffset(int row, int k) {
  return Swizzle128((row / 8) * kAtom + (row % 8) * 128 + k * 2);
}

// The byte offset of element (column, k) in an MN-major stage.
PITH_HOST_DEVICE constexpr int MnMajorOffset(int column, int k) {
  return Swizzle128(((column / 64) * kKGroups + k / 8) * kAtom + (k % 8) * 128 + (column % 64) * 2);
}

// A descriptor's variable parts for the operand's rows (m of A, n of B) from `first` (a
// multiple of 64) on and the k16 slice `slice` (0-3) of a stage: the start's byte offset
// in the stage, and the leading and stride byte offsets.
//   K-major: the 8-row atoms 1024 bytes apart (stride); the leading offset is unused with
//     this swizzle (16: "assumed 1"); a slice starts 32 bytes further into the rows.
//   MN-major: 64-column blocks 8 KiB apart (leading), 8-row k groups 1024 bytes apart
//     (stride); a slice starts two atoms further.
struct DescriptorParts {
  int start;
  int leading;
  int stride;
};
PITH_HOST_DEVICE constexpr DescriptorParts OperandDescriptor(bool mn_major, int first, int slice) {
  if (mn_major) {
    return {((first / 64) * kKGroups + slice * 2) * kAtom, kKGroups * kAtom, kAtom};
  }
  return {(first / 8) * kAtom + slice * 32, 16, kAtom};
}

// The 64-bit descriptor: start address, leading and stride byte offsets (16-byte units, 14
// bits each), 128-byte swizzle (mode 1 in bits 62-63); base offset 0 (atoms on 1024-byte
// boundaries). `address` is the start's shared-memory address.
PITH_HOST_DEVICE constexpr uint64_t Descriptor(uint32_t address, const DescriptorParts& d) {
  return uint64_t{(address & 0x3FFFF) >> 4} |
         (uint64_t{(static_cast<uint32_t>(d.leading) & 0x3FFFF) >> 4} << 16) |
         (uint64_t{(static_cast<uint32_t>(d.stride) & 0x3FFFF) >> 4} << 32) | (uint64_t{1} << 62);
}

}  // namespace pith::cuda::wgmma

#endif  // PITH_WORKER_CUDA_WGMMA_LAYOUT_H_
