// A plain C++ sgemm for builds without OpenBLAS (blas.h). Row-major, single-threaded, one
// accumulation order: a reference for the GPU tests' CPU side, not a fast path.
#ifdef PITH_PORTABLE_BLAS
#include <algorithm>
#include <cstdint>
#include <vector>

#include "worker/compute/blas.h"

void cblas_sgemm(CBLAS_ORDER, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k,
                 float alpha, const float* a, int lda, const float* b, int ldb, float beta,
                 float* c, int ldc) {
  const bool ta = trans_a == CblasTrans, tb = trans_b == CblasTrans;
  std::vector<float> row(n);
  for (int i = 0; i < m; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int p = 0; p < k; ++p) {
      const float av = ta ? a[int64_t{p} * lda + i] : a[int64_t{i} * lda + p];
      if (tb) {
        for (int j = 0; j < n; ++j) row[j] += av * b[int64_t{j} * ldb + p];
      } else {
        const float* bp = b + int64_t{p} * ldb;
        for (int j = 0; j < n; ++j) row[j] += av * bp[j];
      }
    }
    float* ci = c + int64_t{i} * ldc;
    for (int j = 0; j < n; ++j) ci[j] = alpha * row[j] + (beta == 0.0f ? 0.0f : beta * ci[j]);
  }
}

char* openblas_get_corename() {
  static char name[] = "portable";
  return name;
}

namespace {
int g_threads = 1;
}  // namespace

void openblas_set_num_threads(int threads) { g_threads = threads; }
int openblas_get_num_threads() { return g_threads; }
#endif  // PITH_PORTABLE_BLAS
