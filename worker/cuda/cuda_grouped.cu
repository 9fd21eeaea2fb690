// CudaBackend::KernelGemmBf16: Pith's own grouped bf16 product, every problem of a phase in
// one launch. cuBLAS takes a launch (and a few microseconds of host time) per expert
// product; at Qwen3-30B-A3B's shapes a step has 768 of them a layer and the host's launches,
// not the tensor cores, set the pace (tests/bench/RESULTS.md, the H200 runs).
//
// The kernel: one CTA per 128 x 128 output tile of any problem (or 128 x 256, 256 x 128:
// set_kernel_tile; a flat tile list, each CTA finds its problem by binary search over the
// problems' first tiles), a warp per 64 x 64 of the tile, k in steps of 32 through a
// 4-stage cp.async pipeline in shared memory, bf16
// mma.sync.m16n8k16 with fp32 accumulators; ldmatrix (.trans for the operands stored with
// k outermost) feeds the fragments, so every transpose reads its tiles as they lie in
// memory. Out-of-range rows and k steps are zero-filled by cp.async; the epilogue writes
// alpha * acc + beta * C (C not read with beta 0) in fp32 or bf16, then the expert FFN's
// element-wise passes where a problem asks (CudaBackend::Epilogue). mma.sync runs on sm_80
// and later; on sm_90 it leaves the warpgroup MMA (wgmma) unused, which caps it below
// cuBLAS's dense peak.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_grouped.cuh"
#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda {
namespace {

using namespace grouped;  // NOLINT: the kernels' shared parts

cudaStream_t S(CUstream_st* s) { return s; }

constexpr int kBk = 32;  // k per pipeline stage
constexpr int kPad = 8;  // bf16 elements after each shared row: ldmatrix without conflicts

// A tile shape: kBm x kBn outputs a CTA, one warp per 64 x 64 of them, kStages stages.
// An operand's tile is stored [rows][kBk + pad] or [kBk][rows + pad], as it lies in
// memory.
template <int kBmT, int kBnT, int kStagesT>
struct Tile {
  static constexpr int kBm = kBmT, kBn = kBnT, kStages = kStagesT;
  static constexpr int kWarpsM = kBm / 64, kWarpsN = kBn / 64;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int Elems(int rows) {
    return rows * (kBk + kPad) > kBk * (rows + kPad) ? rows * (kBk + kPad) : kBk * (rows + kPad);
  }
  static constexpr int kAElems = Elems(kBm), kBElems = Elems(kBn);
  static constexpr int kStageElems = kAElems + kBElems;
  static constexpr int kSharedBytes = kStages * kStageElems * 2;
  static_assert(kAElems % 8 == 0 && kBElems % 8 == 0, "16-byte aligned tiles");
};
using Tile128x128 = Tile<128, 128, 4>;
using Tile128x256 = Tile<128, 256, 4>;
using Tile256x128 = Tile<256, 128, 4>;

template <bool kTrans>
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  }
}

__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies the `rows` x `cols` tile at (r0, c0) of a row-major matrix (leading dimension ld,
// `max_r` x `max_c` valid) into shared [rows][cols + pad], 16 bytes per cp.async; chunks
// outside are zero-filled. cols is a multiple of 8 and so are max_c and ld.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void LoadTile(__nv_bfloat16* shared, const __nv_bfloat16* g, int ld,
                                         int r0, int c0, int max_r, int max_c) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    const bool valid = r0 + row < max_r && c0 + col < max_c;
    const __nv_bfloat16* src = valid ? g + int64_t{r0 + row} * ld + (c0 + col) : g;
    CpAsync16(shared + row * (kCols + kPad) + col, src, valid);
  }
}

// A stage's tiles of A and B for the k step starting at k0.
template <typename T, bool kTa, bool kTb>
__device__ __forceinline__ void LoadStage(__nv_bfloat16* smem, const KernelProblem& p, int m0,
                                          int n0, int k0) {
  __nv_bfloat16* sa = smem;
  __nv_bfloat16* sb = smem + T::kAElems;
  if (kTa) {  // A stored [k][m]
    LoadTile<kBk, T::kBm, T::kThreads>(sa, p.a, p.lda, k0, m0, p.k, p.m);
  } else {  // A stored [m][k]
    LoadTile<T::kBm, kBk, T::kThreads>(sa, p.a, p.lda, m0, k0, p.m, p.k);
  }
  if (kTb) {  // B stored [n][k]
    LoadTile<T::kBn, kBk, T::kThreads>(sb, p.b, p.ldb, n0, k0, p.n, p.k);
  } else {  // B stored [k][n]
    LoadTile<kBk, T::kBn, T::kThreads>(sb, p.b, p.ldb, k0, n0, p.k, p.n);
  }
}

// The warp's 64 x 64 share of one stage: two k16 steps of 4 x 8 MMAs.
template <typename T, bool kTa, bool kTb>
__device__ __forceinline__ void ComputeStage(float (&acc)[4][8][4], const __nv_bfloat16* smem,
                                             int warp_m, int warp_n, int lane) {
  const __nv_bfloat16* sa = smem;
  const __nv_bfloat16* sb = smem + T::kAElems;
  const int l8 = lane % 8, j1 = (lane / 8) % 2, j2 = lane / 16;
#pragma unroll
  for (int kk = 0; kk < kBk; kk += 16) {
    uint32_t a[4][4], b[4][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int mb = warp_m * 64 + mi * 16;
      if (kTa) {  // [k][m]: matrices (k, m) = (0,0) (0,8) (8,0) (8,8), transposed
        LdMatrixX4<true>(a[mi], sa + (kk + l8 + j2 * 8) * (T::kBm + kPad) + mb + j1 * 8);
      } else {  // [m][k]: (m, k) = (0,0) (8,0) (0,8) (8,8)
        LdMatrixX4<false>(a[mi], sa + (mb + l8 + j1 * 8) * (kBk + kPad) + kk + j2 * 8);
      }
    }
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {  // two n8 blocks each: b[nj] = {b0, b1} x 2
      const int nb = warp_n * 64 + nj * 16;
      if (kTb) {  // [n][k]: (n, k) = (0,0) (0,8) (8,0) (8,8)
        LdMatrixX4<false>(b[nj], sb + (nb + l8 + j2 * 8) * (kBk + kPad) + kk + j1 * 8);
      } else {  // [k][n]: (k, n) = (0,0) (8,0) (0,8) (8,8), transposed
        LdMatrixX4<true>(b[nj], sb + (kk + l8 + j1 * 8) * (T::kBn + kPad) + nb + j2 * 8);
      }
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        Mma(acc[mi][ni], a[mi], b[ni / 2][(ni % 2) * 2], b[ni / 2][(ni % 2) * 2 + 1]);
      }
    }
  }
}

// The warp's fragments into C: acc[mi][ni] holds rows g and g + 8 of its 16 x 8 block,
// columns 2t and 2t + 1.
__device__ __forceinline__ void StoreTile(const KernelProblem& p, const float (&acc)[4][8][4],
                                          int m0, int n0, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        StoreFragment(p, m0 + mi * 16 + g + half * 8, n0 + ni * 8 + 2 * t, acc[mi][ni][2 * half],
                      acc[mi][ni][2 * half + 1]);
      }
    }
  }
}

template <typename T, bool kTa, bool kTb>
__device__ __forceinline__ void RunTile(const KernelProblem& p, int64_t tile, __nv_bfloat16* smem) {
  const int m0 = static_cast<int>(tile / p.tiles_n) * T::kBm;
  const int n0 = static_cast<int>(tile % p.tiles_n) * T::kBn;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / T::kWarpsN, warp_n = warp % T::kWarpsN;
  float acc[4][8][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
    }
  }
  const int steps = (p.k + kBk - 1) / kBk;
  constexpr int kStages = T::kStages, kStageElems = T::kStageElems;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) LoadStage<T, kTa, kTb>(smem + s * kStageElems, p, m0, n0, s * kBk);
    CpAsyncCommit();  // empty groups keep the count uniform
  }
  for (int step = 0; step < steps; ++step) {
    CpAsyncWait<kStages - 2>();  // step's group has landed (for this thread)
    __syncthreads();             // for every thread; and step - 1's stage is free again
    const int next = step + kStages - 1;
    if (next < steps) {
      LoadStage<T, kTa, kTb>(smem + (next % kStages) * kStageElems, p, m0, n0, next * kBk);
    }
    CpAsyncCommit();
    ComputeStage<T, kTa, kTb>(acc, smem + (step % kStages) * kStageElems, warp_m, warp_n, lane);
  }
  CpAsyncWait<0>();
  StoreTile(p, acc, m0 + warp_m * 64, n0 + warp_n * 64, lane);
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads)
    GroupedGemmKernel(const KernelProblem* __restrict__ problems, int count) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  auto* smem = reinterpret_cast<__nv_bfloat16*>(shared_bytes);
  RunThisTile(problems, count, [&](const KernelProblem& p, int64_t local, auto ta, auto tb) {
    RunTile<T, decltype(ta)::value, decltype(tb)::value>(p, local, smem);
  });
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool CudaBackend::KernelTakes(const Bf16Gemm& p) {
  // cp.async moves 16 bytes (8 elements) at a time along each operand's stored rows.
  const int a_row = p.trans_a ? p.m : p.k, b_row = p.trans_b ? p.k : p.n;
  return Aligned16(p.a) && Aligned16(p.b) && p.lda % 8 == 0 && p.ldb % 8 == 0 && a_row % 8 == 0 &&
         b_row % 8 == 0 && (p.c_fp32 || !p.epilogue.any());
}

bool CudaBackend::KernelGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op) {
  for (const Bf16Gemm& p : problems) {
    const bool runs = p.m != 0 && p.n != 0 && (p.k != 0 || p.epilogue.any());
    if (runs && !KernelTakes(p)) return false;
  }
  if (!KernelTileRuns(kernel_tile_)) return false;
  switch (kernel_tile_) {
    case KernelTile::k128x256:
      return LaunchGrouped<Tile128x256>(problems, op);
    case KernelTile::k256x128:
      return LaunchGrouped<Tile256x128>(problems, op);
    case KernelTile::kWgmma128x128:
    case KernelTile::kWgmma128x256:
      return LaunchWgmma(problems, op);
    default:
      return LaunchGrouped<Tile128x128>(problems, op);
  }
}

CudaBackend::KernelTable CudaBackend::UploadKernelTable(const std::vector<Bf16Gemm>& problems,
                                                        int bm, int bn, const char* op) {
  if (!Ready()) return {};
  std::vector<KernelProblem> table;
  int64_t tiles = 0;
  for (const Bf16Gemm& p : problems) {
    // k = 0 with an epilogue still runs (no k step: the epilogue on zeros plus beta C).
    if (p.m == 0 || p.n == 0 || (!p.epilogue.any() && EmptyProductBf16(p, op))) continue;
    const int tiles_m = (p.m + bm - 1) / bm, tiles_n = (p.n + bn - 1) / bn;
    // Column pairs (2t, 2t + 1) start at even columns: whole accesses where rows stay
    // aligned, in C and in every epilogue array.
    const Epilogue& e = p.epilogue;
    auto aligned = [](const void* q, size_t bytes) {
      return reinterpret_cast<uintptr_t>(q) % bytes == 0;
    };
    const bool pairs = p.ldc % 2 == 0 && aligned(p.c, p.c_fp32 ? 8 : 4) &&
                       aligned(e.gelu_grad_of, 8) && aligned(e.c_bf16, 4) &&
                       aligned(e.gelu_out, 8) && aligned(e.gelu_bf16, 4);
    table.push_back({static_cast<const __nv_bfloat16*>(p.a), static_cast<const __nv_bfloat16*>(p.b),
                     p.c, p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.alpha, p.beta,
                     (p.trans_a ? kTransA : 0) | (p.trans_b ? kTransB : 0) |
                         (p.c_fp32 ? kOutFp32 : 0) | (pairs ? kPairs : 0) |
                         (p.beta == 0.0f && !e.any() ? kPlain : 0),
                     tiles_n, tiles, e.bias, e.gelu_grad_of, static_cast<__nv_bfloat16*>(e.c_bf16),
                     e.gelu_out, static_cast<__nv_bfloat16*>(e.gelu_bf16)});
    tiles += int64_t{tiles_m} * tiles_n;
  }
  if (table.empty() || !Ready()) return {};
  if (tiles > INT32_MAX) {
    Fail(op, "a grouped product of more than 2^31 tiles");
    return {};
  }
  void* dev = Scratch(kKernelProblems, table.size() * sizeof(KernelProblem));
  // Pageable source: the copy returns once `table` is staged (see UploadPointers).
  if (dev == nullptr ||
      !CheckCuda(cudaMemcpyAsync(dev, table.data(), table.size() * sizeof(KernelProblem),
                                 cudaMemcpyHostToDevice, S(stream_)),
                 op)) {
    return {};
  }
  return {dev, static_cast<int>(table.size()), tiles};
}

bool CudaBackend::SetKernelSmem(const void* kernel, int bytes) {
  const unsigned shape_bit = 1u << static_cast<int>(kernel_tile_);
  if (kernel_smem_set_ & shape_bit) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
      cudaSuccess) {
    cudaGetLastError();  // not sticky: the products go to cuBLAS instead
    return false;
  }
  kernel_smem_set_ |= shape_bit;
  return true;
}

int CudaBackend::KernelSharedBytes(KernelTile tile) {
  switch (tile) {
    case KernelTile::k128x256:
      return Tile128x256::kSharedBytes;
    case KernelTile::k256x128:
      return Tile256x128::kSharedBytes;
    case KernelTile::kWgmma128x128:
    case KernelTile::kWgmma128x256:
      return WgmmaSharedBytes(tile);
    default:
      return Tile128x128::kSharedBytes;
  }
}

bool CudaBackend::KernelTileRuns(KernelTile tile) {
  if (!Ready()) return false;
  const unsigned bit = 1u << static_cast<int>(tile);
  if (!(tile_fits_known_ & bit)) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_) !=
        cudaSuccess) {
      cudaGetLastError();  // the query's failure is not the backend's: asked again next time
      return false;
    }
    tile_fits_known_ |= bit;
    if (KernelSharedBytes(tile) <= optin) tile_fits_ |= bit;
  }
  if (!(tile_fits_ & bit)) return false;
  if (tile != KernelTile::kWgmma128x128 && tile != KernelTile::kWgmma128x256) return true;
  if (wgmma_runs_ < 0) wgmma_runs_ = ProbeWgmma();
  return wgmma_runs_ == 1;
}

void CudaBackend::CountKernelLaunch(const std::vector<Bf16Gemm>& problems, const char* op) {
  if (!CheckLaunch(op)) return;
  ++kernel_launches_;
  for (const Bf16Gemm& p : problems) {
    if (p.epilogue.any()) {
      ++epilogue_launches_;
      break;
    }
  }
}

namespace {

// CTAs of tile shape T that fit on one SM of the current device at once (0 after an error).
template <typename T>
int BlocksPerSm() {
  return grouped::KernelBlocksPerSm(reinterpret_cast<const void*>(GroupedGemmKernel<T>),
                                    T::kThreads, T::kSharedBytes);
}

}  // namespace

int CudaBackend::KernelBlocksPerSm(KernelTile tile) {
  if (!Ready()) return 0;
  switch (tile) {
    case KernelTile::k128x256:
      return BlocksPerSm<Tile128x256>();
    case KernelTile::k256x128:
      return BlocksPerSm<Tile256x128>();
    case KernelTile::kWgmma128x128:
    case KernelTile::kWgmma128x256:
      return WgmmaBlocksPerSm(tile);
    default:
      return BlocksPerSm<Tile128x128>();
  }
}

template <typename T>
bool CudaBackend::LaunchGrouped(const std::vector<Bf16Gemm>& problems, const char* op) {
  if (!SetKernelSmem(reinterpret_cast<const void*>(GroupedGemmKernel<T>), T::kSharedBytes)) {
    return false;
  }
  const KernelTable table = UploadKernelTable(problems, T::kBm, T::kBn, op);
  if (table.count == 0) return true;
  GroupedGemmKernel<T>
      <<<static_cast<unsigned>(table.tiles), T::kThreads, T::kSharedBytes, S(stream_)>>>(
          static_cast<const KernelProblem*>(table.problems), table.count);
  CountKernelLaunch(problems, op);
  return true;
}

}  // namespace pith::cuda
