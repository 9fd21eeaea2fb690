// Element-wise kernels shared by the CPU backend's translation units. Internal to
// worker/compute.
#ifndef PITH_WORKER_COMPUTE_CPU_KERNELS_H_
#define PITH_WORKER_COMPUTE_CPU_KERNELS_H_

#include <cstdint>

#include "worker/compute/adamw.h"
#include "worker/compute/blas.h"

namespace pith::compute {

// Sets OpenBLAS's thread count for a scope and restores it.
class BlasThreads {
 public:
  explicit BlasThreads(int threads) : saved_(openblas_get_num_threads()) {
    openblas_set_num_threads(threads);
  }
  ~BlasThreads() { openblas_set_num_threads(saved_); }
  BlasThreads(const BlasThreads&) = delete;
  BlasThreads& operator=(const BlasThreads&) = delete;

 private:
  int saved_;
};

// out[i] = gelu_tanh(x[i]) for i in [begin, end).
void GeluRange(float* out, const float* x, int64_t begin, int64_t end);
// dx[i] = dout[i] * gelu_tanh'(x[i]) for i in [begin, end); dx may alias dout.
void GeluBackwardRange(float* dx, const float* x, const float* dout, int64_t begin, int64_t end);

// One AdamW update of elements [begin, end): m, v, then the decayed parameter. The four
// arrays must not overlap.
void AdamWRange(float* param, const float* grad, float* m, float* v, int64_t begin, int64_t end,
                const AdamWConstants& k);

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_CPU_KERNELS_H_
