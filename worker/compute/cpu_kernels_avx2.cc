// The element-wise kernels for AVX2+FMA; cpu_kernels.cc picks them at run time.
#define PITH_KERNEL_NAMESPACE avx2
#include "worker/compute/cpu_kernels.inc"
