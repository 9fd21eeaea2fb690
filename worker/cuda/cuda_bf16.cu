// CudaBackend: the bf16 products (tensor cores, fp32 accumulation), fanned out over side
// streams or as one cuBLAS grouped call, and the fp32 -> bf16 rounding. The backend's own
// handle runs in pedantic math mode (exact fp32, no TF32); the calls on it here switch it
// to the default mode for their own launch, since the pedantic mode may keep bf16
// products off the tensor cores, and back afterwards (the mode is read when a call is
// issued). The side streams' handles stay in the default mode.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_kernels.cuh"

namespace pith::cuda {
namespace {

cudaStream_t S(CUstream_st* s) { return s; }
cublasHandle_t H(cublasContext* h) { return h; }
cublasOperation_t Op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

__global__ void ToBf16Kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  PITH_GRID_STRIDE(i, n) out[i] = __float2bfloat16_rn(in[i]);
}

// Sets the handle's math mode for the lifetime of the object, then restores pedantic.
class DefaultMath {
 public:
  explicit DefaultMath(cublasHandle_t h) : h_(h) { cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH); }
  ~DefaultMath() { cublasSetMathMode(h_, CUBLAS_PEDANTIC_MATH); }
  DefaultMath(const DefaultMath&) = delete;
  DefaultMath& operator=(const DefaultMath&) = delete;

 private:
  cublasHandle_t h_;
};

__global__ void AccumulateBf16Kernel(float* out, const __nv_bfloat16* in, int64_t n) {
  PITH_GRID_STRIDE(i, n) out[i] += __bfloat162float(in[i]);
}

}  // namespace

void CudaBackend::AccumulateBf16(float* out, const void* in, int64_t n) {
  if (n == 0 || !Ready()) return;
  AccumulateBf16Kernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(
      out, static_cast<const __nv_bfloat16*>(in), n);
  CheckLaunch("AccumulateBf16");
}

void CudaBackend::ToBf16(void* out, const float* in, int64_t n) {
  if (n == 0 || !Ready()) return;
  ToBf16Kernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(static_cast<__nv_bfloat16*>(out), in, n);
  CheckLaunch("ToBf16");
}

namespace {

cublasStatus_t GemmEx(cublasHandle_t h, const CudaBackend::Bf16Gemm& p) {
  const float alpha = 1.0f;
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  return cublasGemmEx(h, Op(p.trans_b), Op(p.trans_a), p.n, p.m, p.k, &alpha, p.b, CUDA_R_16BF,
                      p.ldb, p.a, CUDA_R_16BF, p.lda, &p.beta, p.c,
                      p.c_fp32 ? CUDA_R_32F : CUDA_R_16BF, p.ldc, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

}  // namespace

void CudaBackend::GemmBf16(const Bf16Gemm& p, const char* op) {
  if (p.m == 0 || p.n == 0 || p.k == 0 || !Ready()) return;
  DefaultMath math(H(blas_));
  CheckBlas(GemmEx(H(blas_), p), op);
}

bool CudaBackend::MakeSideStreams() {
  if (!side_.streams.empty()) return true;
  for (int i = 0; i < kMaxSideStreams; ++i) {
    cudaStream_t stream = nullptr;
    if (!CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "side stream")) break;
    side_.streams.push_back(stream);
    cublasHandle_t handle = nullptr;
    if (!CheckBlas(cublasCreate(&handle), "side cuBLAS handle")) break;
    side_.handles.push_back(handle);
    if (!CheckBlas(cublasSetStream(handle, stream), "side cuBLAS stream")) break;
  }
  for (int i = 0; error_.ok() && i <= kMaxSideStreams; ++i) {
    cudaEvent_t event = nullptr;
    if (CheckCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "side event")) {
      side_.events.push_back(event);
    }
  }
  if (!error_.ok()) DestroySideStreams();
  return error_.ok();
}

void CudaBackend::DestroySideStreams() {
  for (cublasContext* h : side_.handles) cublasDestroy(H(h));
  for (CUstream_st* s : side_.streams) {
    cudaStreamSynchronize(S(s));
    cudaStreamDestroy(S(s));
  }
  for (CUevent_st* e : side_.events) cudaEventDestroy(e);
  side_ = {};
}

void CudaBackend::FanOutGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op) {
  if (problems.empty() || !Ready() || !MakeSideStreams()) return;
  const int used = std::min<int>(side_streams_, static_cast<int>(problems.size()));
  cudaEvent_t fork = side_.events[kMaxSideStreams];
  if (!CheckCuda(cudaEventRecord(fork, S(stream_)), op)) return;
  for (int i = 0; i < used; ++i) {
    if (!CheckCuda(cudaStreamWaitEvent(S(side_.streams[i]), fork, 0), op)) return;
  }
  for (size_t i = 0; i < problems.size(); ++i) {
    const Bf16Gemm& p = problems[i];
    if (p.m == 0 || p.n == 0 || p.k == 0) continue;
    if (!CheckBlas(GemmEx(H(side_.handles[i % used]), p), op)) return;
  }
  // The join: the backend's stream goes on once every side stream is done.
  for (int i = 0; i < used; ++i) {
    if (!CheckCuda(cudaEventRecord(side_.events[i], S(side_.streams[i])), op) ||
        !CheckCuda(cudaStreamWaitEvent(S(stream_), side_.events[i], 0), op)) {
      return;
    }
  }
}

void CudaBackend::GroupedGemmBf16(const std::vector<Bf16Gemm>& problems, const char* op) {
  if (problems.empty() || !Ready()) return;
  const GroupedArrays<Bf16Gemm> g(problems);
  const void* const* dev = UploadPointers(g.pointers, op);
  if (dev == nullptr) return;
  const int count = g.count;
  DefaultMath math(H(blas_));
  CheckBlas(cublasGemmGroupedBatchedEx(H(blas_), g.ta.data(), g.tb.data(), g.m.data(), g.n.data(),
                                       g.k.data(), g.alpha.data(), dev, CUDA_R_16BF, g.lda.data(),
                                       dev + count, CUDA_R_16BF, g.ldb.data(), g.beta.data(),
                                       const_cast<void* const*>(dev + 2 * count), CUDA_R_16BF,
                                       g.ldc.data(), count, g.size.data(), CUBLAS_COMPUTE_32F),
            op);
}

}  // namespace pith::cuda
