// The expert products of one phase as a few cuBLAS batched calls (cublasGemmBatchedEx):
// host arithmetic, with no CUDA in it, so it is checked with or without nvcc.
//
// A batched call runs many products of one shape, each from its own pointers, in one
// launch that fills the device. The experts' forward, dX and dH products differ only in
// their row counts (tokens per expert), so each is cut into chunks of the same rows: full
// chunks of all products go in one call; a product whose rows are not a multiple of the
// chunk adds a tail chunk ending at its last row, in a second call after the first. The
// tail recomputes rows of the last full chunk, which is harmless where C is overwritten
// (beta 0) and wrong where it accumulates: there the remaining rows run as a product of
// their own, as they do where the tail would start off 16-byte alignment. Products no
// other product shares a shape with, those under kMinRows rows and those whose A, B or C
// is not 16-byte aligned run on their own too (the fan-out, beside the calls). A weight
// gradient's token count is its k, the sum, which is never cut: two experts' share a
// shape only when their counts are equal, so those mostly run on their own.
#ifndef PITH_WORKER_CUDA_BATCH_PLAN_H_
#define PITH_WORKER_CUDA_BATCH_PLAN_H_

#include <cstdint>
#include <vector>

namespace pith::cuda {

// A row-major product C = alpha op(A) op(B) + beta C as CudaBackend::Bf16Gemm holds it:
// A and B bf16 (2 bytes an element), C fp32 or bf16; addresses in bytes.
struct PlanProduct {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  int lda = 0, ldb = 0, ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  bool c_fp32 = true;
  uintptr_t a = 0, b = 0, c = 0;
};

// One batched call: the shape its entries share, and each entry's A, B and C.
struct BatchedCall {
  PlanProduct shape;  // its a, b and c unused
  std::vector<uintptr_t> a, b, c;
  int count() const { return static_cast<int>(a.size()); }
};

struct BatchPlan {
  std::vector<BatchedCall> calls;   // in this order, one after the other
  std::vector<PlanProduct> single;  // each on its own, beside the calls (disjoint outputs)
};

inline constexpr int kBatchRows = 128;  // rows of a chunk
inline constexpr int kMinRows = 16;     // fewer: a product of its own

// The plan for products with m, n and k above 0 whose outputs are disjoint. A product of
// m < kBatchRows takes chunks of the largest of kBatchRows / 2, / 4, ... kMinRows that fits.
BatchPlan PlanBatches(const std::vector<PlanProduct>& products);

// The product of `p`'s rows [first, first + rows): its A and C moved to that row.
PlanProduct RowsOf(const PlanProduct& p, int first, int rows);

}  // namespace pith::cuda

#endif  // PITH_WORKER_CUDA_BATCH_PLAN_H_
