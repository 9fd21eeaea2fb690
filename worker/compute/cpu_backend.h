// CpuBackend: the fp32 CPU implementation of Backend — OpenBLAS sgemm for every matrix
// product and a ThreadPool for the element-wise, normalization and routing loops. It is
// Pith's embedded default and what CI trains with.
//
// Scratch memory grows to the largest shape seen and is then reused, so a training loop
// with fixed shapes allocates nothing after its first step.
//
// Thread safety: as Backend (one thread at a time).
#ifndef PITH_WORKER_COMPUTE_CPU_BACKEND_H_
#define PITH_WORKER_COMPUTE_CPU_BACKEND_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "worker/compute/backend.h"
#include "worker/compute/thread_pool.h"

namespace pith::compute {

// OpenBLAS picks its kernels by CPU model, and on a model it does not know (virtual
// machines report generic ones) it falls back to Prescott's SSE3 kernels: sgemm 2-4x
// slower than the AVX2 or AVX-512 ones the CPU runs. Returns the OPENBLAS_CORETYPE to
// name when this process's OpenBLAS made such a fallback pick ("SkylakeX", "Haswell"),
// else nullopt.
std::optional<std::string> BetterBlasCore();

// The kernels this process's OpenBLAS runs ("SkylakeX", "Haswell", "Prescott", ...).
std::string BlasCoreName();

// If BetterBlasCore() names one and OPENBLAS_CORETYPE is unset, sets it and re-executes
// this program with `argv` (OpenBLAS reads it only as it loads); returns if it does not.
// Call first thing in main, before any thread starts.
void ReexecWithBetterBlasCore(char** argv);

class CpuBackend final : public Backend {
 public:
  // `threads` for the backend's loops and OpenBLAS's (0 = one per core). OpenBLAS's count
  // is process-wide: the last backend constructed sets it. Several workers sharing a
  // host should split its cores (threads = cores / workers): OpenBLAS threads wait for
  // work by spinning, and oversubscribed spinners starve the process that has work.
  explicit CpuBackend(int threads = 0);
  ~CpuBackend() override;

  absl::string_view name() const override { return "cpu"; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  void Zero(void* dst, size_t bytes) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }

  void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
            const float* b, int ldb, float beta, float* c, int ldc) override;
  void AddBias(float* out, const float* bias, int m, int n) override;
  void BiasGrad(float* dbias, const float* dout, int m, int n) override;
  void Add(float* out, const float* a, const float* b, int64_t n) override;
  void Embedding(float* out, const int32_t* tokens, const float* wte, const float* wpe, int batch,
                 int seq, int channels) override;
  void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                         int batch, int seq, int channels) override;
  void LayerNorm(float* out, float* mean, float* rstd, const float* x, const float* w,
                 const float* b, int n, int channels) override;
  void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                         const float* w, const float* mean, const float* rstd, int n,
                         int channels) override;
  void Attention(float* out, float* att, const float* qkv, int batch, int seq, int channels,
                 int heads) override;
  void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                         int batch, int seq, int channels, int heads) override;
  void Gelu(float* out, const float* x, int64_t n) override;
  void GeluBackward(float* dx, const float* x, const float* dout, int64_t n) override;
  void CrossEntropyForwardBackward(float* logits, float* losses, const int32_t* targets, int n,
                                   int vocab, float scale) override;

  double SumOfSquares(const float* x, int64_t n) override;
  void Scale(float* x, float s, int64_t n) override;
  void AdamW(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int64_t step) override;

  void Route(const float* logits, int n, int experts, const RouterConfig& config,
             const RoutingBuffers& out) override;
  void Permute(float* bucket, const float* x, const int32_t* bucket_token, int64_t rows,
               int channels) override;
  void ScatterRows(float* dst, const float* src, const int32_t* dst_row, int64_t rows,
                   int channels) override;
  void PermuteBackward(float* dx, const float* dbucket, const int32_t* row, int n, int top_k,
                       int channels) override;
  void Combine(float* out, const float* y, const int32_t* row, const float* gate, int n, int top_k,
               int channels) override;
  void CombineBackward(float* dy, float* dgate, const float* dout, const float* y,
                       const int32_t* row, const float* gate, int n, int top_k,
                       int channels) override;
  void ExpertForward(float* y, float* hpre, float* h, const float* x, const int64_t* offsets,
                     absl::Span<const ExpertWeights> experts, int channels, int hidden) override;
  void ExpertBackward(float* dx, float* dh, absl::Span<const ExpertGrads> grads, const float* dy,
                      const float* x, const float* hpre, const float* h, const int64_t* offsets,
                      absl::Span<const ExpertWeights> experts, int channels, int hidden) override;
  void RouteBackward(float* dlogits, const float* dgate, const RoutingBuffers& routing, int n,
                     int experts, const RouterConfig& config, const RouterLossGrad& loss) override;

 protected:
  void Free(void* ptr, size_t bytes) override;

 private:
  // Below this many rows per non-empty expert on average, experts run in parallel on the
  // pool with single-threaded GEMMs.
  static constexpr int kParallelExpertRows = 1024;
  bool ExpertsInParallel(const int64_t* offsets, int experts) const;

  // Scratch of at least `n` floats / int64s, reused across calls.
  float* FloatScratch(size_t n);
  int64_t* IntScratch(size_t n);

  ThreadPool pool_;
  std::vector<float> float_scratch_;
  std::vector<int64_t> int_scratch_;
};

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_CPU_BACKEND_H_
