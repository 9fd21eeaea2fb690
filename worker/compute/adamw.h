// AdamW's per-step constants, derived once from the hyperparameters for every backend's
// kernel (DESIGN §3): the CPU and CUDA backends apply the same formula to the same floats.
// Internal to the backends.
#ifndef PITH_WORKER_COMPUTE_ADAMW_H_
#define PITH_WORKER_COMPUTE_ADAMW_H_

#include <cmath>
#include <cstdint>

namespace pith::compute {

struct AdamWConstants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;  // lr / (1 - beta1^t)
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float eps;
  float decay;  // 1 - lr * weight_decay
};

// For the update that makes a tensor's count `step` (1 for the first).
inline AdamWConstants MakeAdamWConstants(float lr, float beta1, float beta2, float eps,
                                         float weight_decay, int64_t step) {
  const double bc1 = 1.0 - std::pow(double{beta1}, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(double{beta2}, static_cast<double>(step));
  AdamWConstants k;
  k.beta1 = beta1;
  k.one_minus_beta1 = 1.0f - beta1;
  k.beta2 = beta2;
  k.one_minus_beta2 = 1.0f - beta2;
  k.step_size = static_cast<float>(lr / bc1);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = eps;
  k.decay = 1.0f - lr * weight_decay;
  return k;
}

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_ADAMW_H_
