// CudaBackend: the NVIDIA GPU implementation of compute::Backend. Every op is issued
// on the backend's one CUDA stream, in call order: cuBLAS for the matrix products (the
// expert GEMMs as one grouped call over the non-empty buckets: cublasSgemmGroupedBatched),
// kernels for the rest (worker/cuda/cuda_kernels.cuh). Exact fp32 by default: cuBLAS runs
// without TF32, so results match the CPU backend's to float rounding. In the bf16 compute
// dtype (SetComputeDtype) Gemm and the expert products round their inputs to bf16 once
// per phase and run on the tensor cores with fp32 accumulation and fp32 outputs; GemmFp32
// (the router) and every other op stay fp32.
//
// Errors: the Backend's ops return nothing, so the first CUDA or cuBLAS failure is kept,
// named by its op ("cuda backend: Gemm: CUBLAS_STATUS_INVALID_VALUE"), every later op is
// skipped, and Synchronize() (and the copies, which synchronize) return it. A fault that
// happens on the device (an illegal address) is only seen at the next synchronizing
// call, and is named by it. A failed backend stays failed: the worker makes a new one.
//
// Host results: Route writes the bucket layout (offsets, routed, prob_sum) to host
// memory, so it waits for the stream; SumOfSquares too. Everything else is asynchronous.
//
// Thread safety: as Backend (one thread at a time). The backend binds its device to the
// calling thread on every entry point that launches work.
#ifndef PITH_WORKER_CUDA_CUDA_BACKEND_H_
#define PITH_WORKER_CUDA_CUDA_BACKEND_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/compute/backend.h"
#include "worker/compute/thread_pool.h"

// The CUDA handle types, declared so that this header needs no CUDA include.
struct CUstream_st;
struct CUevent_st;
struct cublasContext;

namespace pith::cuda {

class CudaBackend final : public compute::Backend {
 public:
  // A backend on device `ordinal`. UNAVAILABLE without a driver or such a device.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int ordinal);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  absl::string_view name() const override { return "cuda"; }
  bool host_addressable() const override { return false; }
  int device() const { return device_; }
  // The device's name and memory, for logs ("NVIDIA H200, 139 GiB").
  const std::string& description() const { return description_; }
  // The first failure so far (OK when none).
  const absl::Status& status() const { return error_; }
  // The stream every op runs on (for DeviceSlots::MakeVisible).
  CUstream_st* stream() const { return stream_; }

  absl::StatusOr<compute::DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  uint64_t device_bytes() const override { return held_->load(std::memory_order_relaxed); }
  // An NCCL communicator (NcclGroup) on this backend's device and stream.
  absl::StatusOr<std::string> NewGroupId() override;
  absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> JoinGroup(
      const std::string& id, int rank, int world, absl::Duration timeout,
      const std::atomic<bool>& abandon) override;
  // DeviceSlots on this backend's device, its uploads ordered before this stream's ops.
  absl::StatusOr<std::unique_ptr<compute::SlotMirror>> MakeSlotMirror(size_t slot_bytes, int slots,
                                                                      void* host,
                                                                      size_t host_bytes) override;
  void Zero(void* dst, size_t bytes) override;
  absl::Status Synchronize() override;

  absl::Status SetComputeDtype(ComputeDtype dtype) override;
  ComputeDtype compute_dtype() const override { return dtype_; }

  void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
            const float* b, int ldb, float beta, float* c, int ldc) override;
  void GemmFp32(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                int lda, const float* b, int ldb, float beta, float* c, int ldc) override;
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

  void Route(const float* logits, int n, int experts, const compute::RouterConfig& config,
             const compute::RoutingBuffers& out) override;
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
                     absl::Span<const compute::ExpertWeights> experts, int channels,
                     int hidden) override;
  void ExpertBackward(float* dx, float* dh, absl::Span<const compute::ExpertGrads> grads,
                      const float* dy, const float* x, const float* hpre, const float* h,
                      const int64_t* offsets, absl::Span<const compute::ExpertWeights> experts,
                      int channels, int hidden) override;
  void RouteBackward(float* dlogits, const float* dgate, const compute::RoutingBuffers& routing,
                     int n, int experts, const compute::RouterConfig& config,
                     const compute::RouterLossGrad& loss) override;

  // bf16 matrix products with fp32 accumulation on the tensor cores, row-major as Gemm:
  // a and b hold bf16 (2-byte storage), c holds bf16, or fp32 with `c_fp32` (the bf16
  // compute dtype writes fp32 activations and accumulates weight gradients into fp32 with
  // beta 1). gpu_bench measures them alone.
  //
  // What the grouped kernel (KernelGemmBf16) may do with each output v = alpha acc + beta C
  // on its way out, in this order, so that the expert FFN's element-wise passes need no
  // pass of their own: v += bias[col]; v *= gelu'(gelu_grad_of[row, col]); C = v;
  // c_bf16 = bf16(v); gelu_out = gelu(v) and gelu_bf16 = bf16(gelu(v)). Each is skipped
  // when its pointer is null. The arrays are fp32 but for the _bf16 ones, with C's leading
  // dimension, and C is fp32 whenever any is set. The same operations, in the same
  // order and precision, as the element-wise kernels they replace.
  struct Epilogue {
    const float* bias = nullptr;
    const float* gelu_grad_of = nullptr;
    void* c_bf16 = nullptr;
    float* gelu_out = nullptr;
    void* gelu_bf16 = nullptr;
    bool any() const {
      return bias != nullptr || gelu_grad_of != nullptr || c_bf16 != nullptr ||
             gelu_out != nullptr || gelu_bf16 != nullptr;
    }
  };
  struct Bf16Gemm {
    bool trans_a, trans_b;
    int m, n, k;
    const void* a;
    int lda;
    const void* b;
    int ldb;
    float beta;
    void* c;
    int ldc;
    bool c_fp32 = false;
    float alpha = 1.0f;
    Epilogue epilogue = {};  // KernelGemmBf16 only; the other calls refuse one
  };
  // A product with k = 0 adds nothing: beta 1 leaves C, beta 0 zeroes it; other betas
  // are an error (Gemm scales C by any beta; the bf16 products have no use for it).
  //
  // The expert products of one phase, in stream order on the backend's stream: the
  // problems (writing disjoint outputs: they run concurrently) are spread round-robin
  // over side_streams() side streams (a cuBLAS handle each)
  // that fork from the stream and join it again through events. Measured on an H200 this
  // runs the FFN's bf16 products at 1.1-1.9x cuBLAS's grouped call
  // (cublasGemmGroupedBatchedEx, GroupedGemmBf16), which also cannot write fp32.
  static constexpr int kMaxSideStreams = 8;
  int side_streams() const { return side_streams_; }
  void set_side_streams(int n) { side_streams_ = std::clamp(n, 1, kMaxSideStreams); }
  // Host threads that issue a fan-out's launches (each side stream's share from one
  // thread, the caller's included): many small products are bound by the host's cost per
  // launch. 1 (the default) issues them all from the caller's thread.
  int launch_threads() const { return launch_threads_; }
  void set_launch_threads(int n);
  void FanOutGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op);
  // One cuBLAS call over every problem (cublasGemmGroupedBatchedEx); c must be bf16 and no
  // problem empty (an error otherwise).
  void GroupedGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op);
  // The problems as a few cublasGemmBatchedEx calls of equal row chunks (batch_plan.h),
  // the rest fanned out, so that a phase of many small products fills the device in a few
  // launches. Problems write disjoint outputs, as for the fan-out; no epilogue. Where this
  // cuBLAS takes no batched call of these types, everything is fanned out from then on.
  void BatchedGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op);
  uint64_t batched_calls() const { return batched_calls_; }  // launched so far
  // Pith's own grouped kernel (cuda_grouped.cu): every problem in one launch, any mix of
  // transposes, fp32 or bf16 C, any alpha and beta, empty problems as FanOutGemmBf16 does
  // them. It takes a problem whose a and b are 16-byte aligned, whose leading dimensions
  // and stored row lengths (A: trans_a ? m : k; B: trans_b ? k : n) are multiples of 8:
  // KernelTakes. False (nothing done) when some problem is not taken, or the tile shape
  // does not run here (KernelTileRuns).
  static bool KernelTakes(const Bf16Gemm& p);
  bool KernelGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op);
  // The grouped kernel's launches so far, and those with an epilogue (tests: that a phase
  // went through it, with its element-wise passes).
  uint64_t kernel_launches() const { return kernel_launches_; }
  uint64_t epilogue_launches() const { return epilogue_launches_; }
  // The grouped kernel and its output tile per CTA: gpu_bench measures each; 128 x 128
  // mma.sync by default. The mma.sync kernel (cuda_grouped.cu, sm_80 and later) takes a
  // warp per 64 x 64 of the tile; the warpgroup-MMA one (cuda_wgmma.cu, sm_90a: wgmma
  // from 128-byte-swizzled shared memory) a warpgroup per 64 rows of it.
  enum class KernelTile { k128x128, k128x256, k256x128, kWgmma128x128, kWgmma128x256 };
  KernelTile kernel_tile() const { return kernel_tile_; }
  void set_kernel_tile(KernelTile tile) { kernel_tile_ = tile; }
  // Whether this device and build run `tile`: a shape whose shared memory a block of this
  // device cannot have (the 120 KiB mma.sync ones past sm_86's 99 KiB) does not; the
  // wgmma ones need an sm_90 device and the build's sm_90a code (a probe kernel says,
  // once). KernelGemmBf16 with a tile that does not run takes nothing (false).
  bool KernelTileRuns(KernelTile tile);
  // How many CTAs of that tile shape one SM holds at once (registers and shared memory
  // allowing), for gpu_bench; 0 when the query fails.
  int KernelBlocksPerSm(KernelTile tile);
  // What runs the bf16 compute dtype's expert products: the cuBLAS fan-out (the default),
  // the grouped kernel (where it takes every problem of a phase; else the fan-out) or
  // cuBLAS's batched calls (BatchedGemmBf16).
  enum class Bf16Products { kFanOut, kKernel, kBatched };
  Bf16Products bf16_products() const { return bf16_products_; }
  void set_bf16_products(Bf16Products how) { bf16_products_ = how; }
  void GemmBf16(const Bf16Gemm& p, const char* op);
  // out[i] = bf16(in[i]), rounded to nearest even.
  void ToBf16(void* out, const float* in, int64_t n);
  // out[i] += float(in[i]) for bf16 `in`.
  void AccumulateBf16(float* out, const void* in, int64_t n);

 protected:
  void Free(void* ptr, size_t bytes) override;

 private:
  // One matrix product of a grouped GEMM, row-major as in Gemm.
  struct GemmProblem {
    bool trans_a, trans_b;
    int m, n, k;
    const float* a;
    int lda;
    const float* b;
    int ldb;
    float beta;
    float* c;
    int ldc;
    float alpha = 1.0f;
    // In bf16 only: b already in bf16 (an expert's bf16 weights), read as it is; b unused.
    const void* b_bf16 = nullptr;
    // In bf16 only: a already in bf16 too (an activation an earlier phase's epilogue wrote).
    const void* a_bf16 = nullptr;
    // In bf16 with the grouped kernel only (see Products).
    Epilogue epilogue = {};
  };
  // Per-bucket segment tables for the expert kernels: one entry per non-empty bucket.
  struct Segments {
    int count = 0;
    int64_t* offsets = nullptr;    // device [count + 1]: the rows of segment i
    const float** bias = nullptr;  // device [count]
    float** bias_grad = nullptr;   // device [count]
    bool aligned = true;           // every pointer 16-byte aligned (float4 rows)
  };

  CudaBackend(int device, CUstream_st* stream, cublasContext* blas, std::string description);

  // Whether to go on: false once an op failed (the op is then skipped). Binds the device.
  bool Ready();
  // Keeps the first failure, named by `op`; returns whether `ok`.
  bool Fail(const char* op, const std::string& what);
  bool CheckCuda(int err, const char* op);
  bool CheckBlas(int status, const char* op);
  // After a kernel launch: whether it launched.
  bool CheckLaunch(const char* op);

  void GroupedGemm(const std::vector<GemmProblem>& problems, const char* op);
  // The products of one phase in the compute dtype: fp32, one grouped call; bf16,
  // ProductsBf16. Whether the problems' epilogues were applied: true when none has one;
  // false (the products done, their epilogues not) unless the grouped kernel ran them.
  bool Products(const std::vector<GemmProblem>& problems, const char* op);
  // The fp32 problems in bf16: every input range they read (operands that overlap or touch
  // merged, so a bucket phase rounds its activation once; a_bf16 and b_bf16 are read as
  // they are) rounded by one kernel into kBf16 scratch, then run by the grouped kernel
  // (where chosen and it takes them) or fanned out (FanOutGemmBf16), with fp32 outputs.
  bool ProductsBf16(const std::vector<GemmProblem>& problems, const char* op);
  // ProductsBf16's second half: the products on the rounded inputs (`rounded` holds the
  // bf16 copy of merged range i from element starts[i]).
  bool RunBf16Products(const std::vector<GemmProblem>& problems,
                       const std::vector<std::pair<uintptr_t, uintptr_t>>& merged,
                       const std::vector<int64_t>& starts, const void* rounded, const char* op);
  // Whether the expert FFN's element-wise passes go into its products' epilogues: the
  // bf16 compute dtype with the grouped kernel chosen.
  bool FuseExpertPasses() const {
    return dtype_ == ComputeDtype::kBf16 && bf16_products_ == Bf16Products::kKernel;
  }
  // Copies a grouped product's pointer arrays to device scratch; nullptr after a failure.
  const void* const* UploadPointers(const std::vector<const void*>& pointers, const char* op);
  // Device scratch of at least `bytes` per use, reused across calls (it grows after
  // waiting for the stream). Ops on the stream are ordered, so a slot is free again once
  // the next op that uses it is issued.
  enum ScratchSlot {
    kPointers,
    kSumOfSquares,
    kAttention,
    kSegments,
    kRouting,         // Route's results for the host; RouteBackward's global f
    kRouteTiles,      // Route's per-tile expert counts
    kBf16Ranges,      // ProductsBf16's table of ranges to round
    kBf16,            // ProductsBf16's rounded inputs
    kKernelProblems,  // KernelGemmBf16's problem table
    kBf16Activation,  // an activation's bf16 copy from one expert phase to the next
    kScratchSlots
  };
  void* Scratch(ScratchSlot slot, size_t bytes);
  // Uploads the non-empty buckets' row ranges (and bias pointers) for the expert kernels.
  Segments UploadSegments(const int64_t* offsets, int experts, const float* const* bias,
                          float* const* bias_grad);

  int device_;
  CUstream_st* stream_;
  cublasContext* blas_;
  std::string description_;
  absl::Status error_;
  ComputeDtype dtype_ = ComputeDtype::kFp32;
  struct ScratchBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  ScratchBuffer scratch_[kScratchSlots];
  // The device bytes held: buffers, scratch and slot mirrors (which hold a reference).
  std::shared_ptr<std::atomic<uint64_t>> held_ = std::make_shared<std::atomic<uint64_t>>(0);
  // FanOutGemmBf16's side streams, handles and events (made on first use; the last
  // event of the array is the fork point).
  struct SideStreams {
    std::vector<CUstream_st*> streams;
    std::vector<cublasContext*> handles;
    std::vector<CUevent_st*> events;
  };
  bool MakeSideStreams();
  void DestroySideStreams();
  // FanOutGemmBf16, calling `alongside` (when set) on the backend's stream between the
  // fork and the join, so that its work runs beside the side streams'.
  void FanOutBf16(const std::vector<Bf16Gemm>& problems, const char* op,
                  const std::function<void()>& alongside);
  // Whether `p` is empty (m, n or k 0), after doing what an empty product does.
  bool EmptyProductBf16(const Bf16Gemm& p, const char* op);
  SideStreams side_;
  bool side_failed_ = false;          // they could not be made: not tried again
  bool batched_unsupported_ = false;  // cuBLAS refused a batched call's types: fan out
  int side_streams_ = 4;
  Bf16Products bf16_products_ = Bf16Products::kFanOut;
  // KernelGemmBf16's problem table for output tiles of bm x bn, on the device (kKernelProblems
  // scratch): its problems (count 0: nothing to launch, or a failure) and their tiles.
  struct KernelTable {
    const void* problems = nullptr;
    int count = 0;
    int64_t tiles = 0;
  };
  KernelTable UploadKernelTable(const std::vector<Bf16Gemm>& problems, int bm, int bn,
                                const char* op);
  // Raises `kernel`'s dynamic shared-memory limit to `bytes`, once per tile shape; false
  // (the backend unharmed: the caller's products go another way) where the device refuses.
  bool SetKernelSmem(const void* kernel, int bytes);
  // Dynamic shared memory of one CTA of `tile` (cuda_grouped.cu; the wgmma shapes' from
  // WgmmaSharedBytes, cuda_wgmma.cu).
  static int KernelSharedBytes(KernelTile tile);
  static int WgmmaSharedBytes(KernelTile tile);
  // The wgmma probe of KernelTileRuns: 1 when the build's sm_90a code runs here, 0 when
  // it cannot, -1 when this time did not tell (asked again next time).
  int ProbeWgmma();
  // After a grouped kernel's launch: whether it launched, counted.
  void CountKernelLaunch(const std::vector<Bf16Gemm>& problems, const char* op);
  // KernelGemmBf16 with the mma.sync tile shape T (cuda_grouped.cu); with the wgmma tile
  // shape kernel_tile_ (cuda_wgmma.cu).
  template <typename T>
  bool LaunchGrouped(const std::vector<Bf16Gemm>& problems, const char* op);
  bool LaunchWgmma(const std::vector<Bf16Gemm>& problems, const char* op);
  int WgmmaBlocksPerSm(KernelTile tile);
  int wgmma_runs_ = -1;  // ProbeWgmma's answer once it told: -1 not yet, else 0 or 1
  unsigned tile_fits_ = 0, tile_fits_known_ = 0;  // bit per tile shape: its shared memory fits
  KernelTile kernel_tile_ = KernelTile::k128x128;
  unsigned kernel_smem_set_ = 0;  // bit per tile shape: its shared-memory limit was raised
  uint64_t kernel_launches_ = 0;
  uint64_t epilogue_launches_ = 0;
  uint64_t batched_calls_ = 0;
  int launch_threads_ = 1;
  std::unique_ptr<compute::ThreadPool> launch_pool_;  // launch_threads_ > 1 only
  std::vector<int64_t> host_back_;                    // Route's results, copied back
};

}  // namespace pith::cuda

#endif  // PITH_WORKER_CUDA_CUDA_BACKEND_H_
