// Element-wise kernels shared by the CPU backend's translation units. Internal to
// worker/compute.
#ifndef PITH_WORKER_COMPUTE_CPU_KERNELS_H_
#define PITH_WORKER_COMPUTE_CPU_KERNELS_H_

#include <cstdint>

namespace pith::compute {

// out[i] = gelu_tanh(x[i]) for i in [begin, end).
void GeluRange(float* out, const float* x, int64_t begin, int64_t end);
// dx[i] = dout[i] * gelu_tanh'(x[i]) for i in [begin, end); dx may alias dout.
void GeluBackwardRange(float* dx, const float* x, const float* dout, int64_t begin, int64_t end);

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_CPU_KERNELS_H_
