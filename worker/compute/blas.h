// The BLAS the CPU backend calls: OpenBLAS's CBLAS, or, in a build with PITH_PORTABLE_BLAS
// (the GPU-only build of tests/gpu/run.sh, on a machine without OpenBLAS), the plain C++
// sgemm of portable_blas.cc under the same names. The portable one is a reference for
// small test shapes, not a fast path. Internal to worker/compute.
#ifndef PITH_WORKER_COMPUTE_BLAS_H_
#define PITH_WORKER_COMPUTE_BLAS_H_

#ifndef PITH_PORTABLE_BLAS
#include <cblas.h>
#else
enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };
// Row-major only (the CPU backend's one order).
void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n,
                 int k, float alpha, const float* a, int lda, const float* b, int ldb, float beta,
                 float* c, int ldc);
char* openblas_get_corename();
void openblas_set_num_threads(int threads);
int openblas_get_num_threads();
#endif

#endif  // PITH_WORKER_COMPUTE_BLAS_H_
