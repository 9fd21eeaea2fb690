// The element-wise kernels for the baseline ISA, and the run-time choice between them and
// the AVX2+FMA build.
#include "worker/compute/cpu_kernels.h"

#define PITH_KERNEL_NAMESPACE baseline
#include "worker/compute/cpu_kernels.inc"

namespace pith::compute {
namespace avx2 {
void GeluRange(float* out, const float* x, int64_t begin, int64_t end);
void GeluBackwardRange(float* dx, const float* x, const float* dout, int64_t begin, int64_t end);
void AdamWRange(float* param, const float* grad, float* m, float* v, int64_t begin, int64_t end,
                const AdamWConstants& k);
}  // namespace avx2

namespace {

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

}  // namespace

void GeluRange(float* out, const float* x, int64_t begin, int64_t end) {
  if (HasAvx2()) {
    avx2::GeluRange(out, x, begin, end);
  } else {
    baseline::GeluRange(out, x, begin, end);
  }
}

void GeluBackwardRange(float* dx, const float* x, const float* dout, int64_t begin, int64_t end) {
  if (HasAvx2()) {
    avx2::GeluBackwardRange(dx, x, dout, begin, end);
  } else {
    baseline::GeluBackwardRange(dx, x, dout, begin, end);
  }
}

void AdamWRange(float* param, const float* grad, float* m, float* v, int64_t begin, int64_t end,
                const AdamWConstants& k) {
  if (HasAvx2()) {
    avx2::AdamWRange(param, grad, m, v, begin, end, k);
  } else {
    baseline::AdamWRange(param, grad, m, v, begin, end, k);
  }
}

}  // namespace pith::compute
