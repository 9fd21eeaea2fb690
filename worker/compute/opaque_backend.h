// OpaqueBackend (tests only): the CPU backend's math on memory the host may not touch,
// as a GPU's. Its buffers are mappings of their own kept PROT_NONE except while one of
// its ops or copies runs, so code on the calling thread that reads or writes backend
// memory directly, instead of through CopyToHost/CopyToDevice, dies with SIGSEGV in a
// test on a 2-core VM rather than computing garbage on a GPU. The copies and the expert
// ops also check which side each pointer is on (device memory inside its buffers, host
// memory outside) and abort, naming the op, on the wrong kind. Not caught: another
// thread's access while an op runs, and system calls on the pages (EFAULT).
// host_addressable() is false, as for CUDA.
//
// It takes the bf16 compute dtype as an emulation, for tests of the paths a bf16 job takes
// (its experts' bf16 weights blobs): the experts' weight matrices are rounded to bf16 (or
// widened from a bf16 blob) before the CPU's fp32 math runs; nothing else is rounded.
// Standalone and on a cluster worker it thus computes the same numbers, as the CUDA
// backend does, but not the CUDA backend's numbers.
//
// Thread safety: as Backend (one thread at a time); each instance guards its own buffers.
#ifndef PITH_WORKER_COMPUTE_OPAQUE_BACKEND_H_
#define PITH_WORKER_COMPUTE_OPAQUE_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <initializer_list>
#include <map>

#include "worker/compute/cpu_backend.h"

namespace pith::compute {

class OpaqueBackend : public Backend {
 public:
  explicit OpaqueBackend(int threads = 1) : cpu_(threads) {}
  ~OpaqueBackend() override;

  absl::string_view name() const override { return "opaque"; }
  bool host_addressable() const override { return false; }
  uint64_t device_bytes() const override { return held_.load(std::memory_order_relaxed); }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  // An in-process stand-in for NCCL among this process's OpaqueBackends (opaque_group.cc):
  // rank-order sums through host copies, with NCCL's deadlines and aborts.
  absl::StatusOr<std::string> NewGroupId() override;
  absl::StatusOr<std::unique_ptr<DeviceGroup>> JoinGroup(const std::string& id, int rank, int world,
                                                         absl::Duration timeout,
                                                         const std::atomic<bool>& abandon) override;
  // Its uploads copy at once but check at WaitCopies that the host bytes did not change
  // meanwhile (aborting, naming it), as a GPU's copy stream may read them late; its
  // downloads leave NaNs in the host memory until WaitSlot or WaitCopies lands them, and
  // fail for a slot used since its last Release.
  absl::StatusOr<std::unique_ptr<SlotMirror>> MakeSlotMirror(size_t slot_bytes, int slots,
                                                             void* host,
                                                             size_t host_bytes) override;
  void Zero(void* dst, size_t bytes) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status SetComputeDtype(ComputeDtype dtype) override {
    dtype_ = dtype;
    return absl::OkStatus();
  }
  ComputeDtype compute_dtype() const override { return dtype_; }

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
  // Opens every buffer for the scope of one op or copy.
  class Open {
   public:
    explicit Open(OpaqueBackend* b) : b_(b) { b_->Protect(false); }
    ~Open() { b_->Protect(true); }
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;

   private:
    OpaqueBackend* b_;
  };
  void Protect(bool closed);
  // Whether [p, p + bytes) lies in one of this backend's buffers.
  bool Inside(const void* p, size_t bytes) const;
  // Aborts naming `op` unless each of `device` is inside (or null) and `host` outside.
  void Expect(const char* op, std::initializer_list<const void*> device,
              const void* host = nullptr) const;

  CpuBackend cpu_;
  ComputeDtype dtype_ = ComputeDtype::kFp32;
  std::map<void*, size_t> mappings_;  // buffer -> mapped bytes
  std::atomic<uint64_t> held_{0};     // their sum
};

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_OPAQUE_BACKEND_H_
