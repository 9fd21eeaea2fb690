// CudaBackend: lifecycle, memory, errors, the matrix products and the optimizer ops. The
// dense layers' kernels live in cuda_dense.cu, the MoE ops in cuda_moe.cu.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/compute/adamw.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_kernels.cuh"
#include "worker/cuda/device_slots.h"
#include "worker/cuda/nccl_group.h"

namespace pith::cuda {
namespace {

cudaStream_t S(CUstream_st* s) { return s; }
cublasHandle_t H(cublasContext* h) { return h; }

__global__ void ScaleMatrixKernel(float* c, int m, int n, int ldc, float beta) {
  PITH_GRID_STRIDE(i, int64_t{m} * n) {
    float& v = c[(i / n) * ldc + i % n];
    v = beta == 0.0f ? 0.0f : v * beta;
  }
}

__global__ void AddBiasKernel(float* out, const float* bias, int m, int n) {
  PITH_GRID_STRIDE(i, int64_t{m} * n) out[i] += bias[i % n];
}

__global__ void BiasGradKernel(float* dbias, const float* dout, int m, int n) {
  ColumnSumInto(dbias, dout, 0, m, n);
}

__global__ void AddKernel(float* out, const float* a, const float* b, int64_t n) {
  PITH_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

__global__ void ScaleKernel(float* x, float s, int64_t n) { PITH_GRID_STRIDE(i, n) x[i] *= s; }

// Partial sums of squares in double, one per block, summed in order by the second pass:
// the same result on every run.
__global__ void SumOfSquaresKernel(double* partial, const float* x, int64_t n) {
  __shared__ double shared[32];
  double sum = 0;
  PITH_GRID_STRIDE(i, n) sum += double{x[i]} * x[i];
  sum = BlockSum(sum, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

__global__ void SumPartialsKernel(double* out, const double* partial, int count) {
  __shared__ double shared[32];
  double sum = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
  sum = BlockSum(sum, shared);
  if (threadIdx.x == 0) *out = sum;
}

// The CPU backend's formula, one rounding per operation (no fused multiply-adds).
__global__ void AdamWKernel(float* __restrict__ param, const float* __restrict__ grad,
                            float* __restrict__ m, float* __restrict__ v, int64_t n,
                            compute::AdamWConstants k) {
  PITH_GRID_STRIDE(i, n) {
    const float g = grad[i];
    const float mi = __fadd_rn(__fmul_rn(k.beta1, m[i]), __fmul_rn(k.one_minus_beta1, g));
    const float vi =
        __fadd_rn(__fmul_rn(k.beta2, v[i]), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
    param[i] =
        __fsub_rn(__fmul_rn(param[i], k.decay), __fdiv_rn(__fmul_rn(k.step_size, mi), denom));
  }
}

cublasOperation_t Op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int ordinal) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cuda backend: no CUDA device: ", cudaGetErrorString(err)));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(
        absl::StrCat("cuda backend: no device ", ordinal, " (this host has ", count, ")"));
  }
  if ((err = cudaSetDevice(ordinal)) != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cuda backend: cudaSetDevice(", ordinal, "): ", cudaGetErrorString(err)));
  }
  cudaDeviceProp prop{};
  if ((err = cudaGetDeviceProperties(&prop, ordinal)) != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cuda backend: device properties: ", cudaGetErrorString(err)));
  }
  cudaStream_t stream = nullptr;
  if ((err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)) != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cuda backend: cudaStreamCreate: ", cudaGetErrorString(err)));
  }
  cublasHandle_t blas = nullptr;
  cublasStatus_t st = cublasCreate(&blas);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetStream(blas, stream);
  // Exact fp32: no TF32 tensor-core rounding of the inputs.
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetMathMode(blas, CUBLAS_PEDANTIC_MATH);
  if (st != CUBLAS_STATUS_SUCCESS) {
    if (blas != nullptr) cublasDestroy(blas);
    cudaStreamDestroy(stream);
    return absl::UnavailableError(
        absl::StrCat("cuda backend: cuBLAS: ", cublasGetStatusString(st)));
  }
  std::string description = absl::StrCat(prop.name, " (sm_", prop.major, prop.minor, ", ",
                                         prop.totalGlobalMem >> 30, " GiB)");
  return std::unique_ptr<CudaBackend>(
      new CudaBackend(ordinal, stream, blas, std::move(description)));
}

CudaBackend::CudaBackend(int device, CUstream_st* stream, cublasContext* blas,
                         std::string description)
    : device_(device), stream_(stream), blas_(blas), description_(std::move(description)) {}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(S(stream_));
  DestroySideStreams();
  for (ScratchBuffer& s : scratch_) {
    if (s.ptr != nullptr) cudaFree(s.ptr);
  }
  cublasDestroy(H(blas_));
  cudaStreamDestroy(S(stream_));
}

bool CudaBackend::Ready() {
  if (!error_.ok()) return false;
  return CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
}

bool CudaBackend::Fail(const char* op, const std::string& what) {
  error_.Update(
      absl::InternalError(absl::StrCat("cuda backend: ", op, ": ", what)));  // keeps the first
  return false;
}

bool CudaBackend::CheckCuda(int err, const char* op) {
  if (err == cudaSuccess) return true;
  return Fail(op, cudaGetErrorString(static_cast<cudaError_t>(err)));
}

bool CudaBackend::CheckBlas(int status, const char* op) {
  if (status == CUBLAS_STATUS_SUCCESS) return true;
  return Fail(op, cublasGetStatusString(static_cast<cublasStatus_t>(status)));
}

bool CudaBackend::CheckLaunch(const char* op) { return CheckCuda(cudaGetLastError(), op); }

void* CudaBackend::Scratch(ScratchSlot slot, size_t bytes) {
  ScratchBuffer& s = scratch_[slot];
  if (s.bytes >= bytes) return s.ptr;
  if (s.ptr != nullptr) {
    // Its last reader must be done; an error here is an earlier op's, named as such.
    if (!CheckCuda(cudaStreamSynchronize(S(stream_)), "an op before a scratch buffer grew")) {
      return nullptr;
    }
    cudaFree(s.ptr);
    *held_ -= s.bytes;
    s = {};
  }
  const size_t rounded = std::max<size_t>(bytes, 4096);
  if (!CheckCuda(cudaMalloc(&s.ptr, rounded), "scratch cudaMalloc")) {
    s.ptr = nullptr;
    return nullptr;
  }
  s.bytes = rounded;
  *held_ += rounded;
  return s.ptr;
}

absl::StatusOr<compute::DeviceBuffer> CudaBackend::Allocate(size_t bytes) {
  if (bytes == 0) return compute::DeviceBuffer(this, nullptr, 0);
  if (!Ready()) return error_;
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky: clear it
    return absl::ResourceExhaustedError(absl::StrCat("cuda backend: cannot allocate ", bytes,
                                                     " bytes on device ", device_, ": ",
                                                     cudaGetErrorString(err)));
  }
  if (!CheckCuda(cudaMemsetAsync(p, 0, bytes, S(stream_)), "Allocate (zero)")) {
    cudaFree(p);
    return error_;
  }
  *held_ += bytes;
  return compute::DeviceBuffer(this, p, bytes);
}

void CudaBackend::Free(void* ptr, size_t bytes) {
  cudaSetDevice(device_);
  cudaFree(ptr);  // waits for the work that may still use it
  *held_ -= bytes;
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return error_;
  if (!Ready()) return error_;
  CheckCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, S(stream_)), "CopyToDevice");
  return Synchronize();
}

absl::Status CudaBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return error_;
  if (!Ready()) return error_;
  CheckCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, S(stream_)), "CopyToHost");
  return Synchronize();
}

absl::StatusOr<std::string> CudaBackend::NewGroupId() { return NcclGroup::NewId(); }

absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> CudaBackend::JoinGroup(
    const std::string& id, int rank, int world, absl::Duration timeout,
    const std::atomic<bool>& abandon) {
  absl::StatusOr<std::unique_ptr<NcclGroup>> joined =
      NcclGroup::Join(id, rank, world, device_, timeout, &abandon);
  if (!joined.ok()) return joined.status();
  return AsDeviceGroup(std::move(*joined), stream_);
}

absl::StatusOr<std::unique_ptr<compute::SlotMirror>> CudaBackend::MakeSlotMirror(
    size_t slot_bytes, int slots, void* host, size_t host_bytes) {
  return MakeCudaSlotMirror(device_, stream_, slot_bytes, slots, host, host_bytes, held_);
}

void CudaBackend::Zero(void* dst, size_t bytes) {
  if (bytes == 0 || !Ready()) return;
  CheckCuda(cudaMemsetAsync(dst, 0, bytes, S(stream_)), "Zero");
}

absl::Status CudaBackend::Synchronize() {
  if (!error_.ok()) return error_;
  if (CheckCuda(cudaSetDevice(device_), "cudaSetDevice")) {
    CheckCuda(cudaStreamSynchronize(S(stream_)),
              "Synchronize (an earlier op failed on the device)");
  }
  return error_;
}

void CudaBackend::Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                       int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  if (dtype_ == ComputeDtype::kBf16 && m != 0 && n != 0 && k != 0) {
    ProductsBf16({{trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc, alpha}}, "Gemm (bf16)");
    return;
  }
  GemmFp32(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void CudaBackend::GemmFp32(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                           const float* a, int lda, const float* b, int ldb, float beta, float* c,
                           int ldc) {
  if (m == 0 || n == 0 || !Ready()) return;
  if (k == 0) {
    // As the CPU backend: beta = 0 means "written", whatever the BLAS does for k = 0.
    ScaleMatrixKernel<<<GridFor(int64_t{m} * n), kThreads, 0, S(stream_)>>>(c, m, n, ldc, beta);
    CheckLaunch("Gemm (k = 0)");
    return;
  }
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  CheckBlas(cublasSgemm(H(blas_), Op(trans_b), Op(trans_a), n, m, k, &alpha, b, ldb, a, lda, &beta,
                        c, ldc),
            "Gemm");
}

const void* const* CudaBackend::UploadPointers(const std::vector<const void*>& pointers,
                                               const char* op) {
  // The pointer arrays live in device memory. A host-to-device cudaMemcpyAsync from
  // pageable memory returns once the source is copied to staging memory (CUDA runtime API,
  // "API synchronization behavior"), so `pointers` may go when it returns. Every upload
  // of this backend relies on that.
  void* dev = Scratch(kPointers, pointers.size() * sizeof(void*));
  if (dev == nullptr ||
      !CheckCuda(cudaMemcpyAsync(dev, pointers.data(), pointers.size() * sizeof(void*),
                                 cudaMemcpyHostToDevice, S(stream_)),
                 op)) {
    return nullptr;
  }
  return static_cast<const void* const*>(dev);
}

void CudaBackend::GroupedGemm(const std::vector<GemmProblem>& problems, const char* op) {
  if (problems.empty() || !Ready()) return;
  const GroupedArrays<GemmProblem> g(problems);
  const void* const* uploaded = UploadPointers(g.pointers, op);
  if (uploaded == nullptr) return;
  const float* const* dev = reinterpret_cast<const float* const*>(uploaded);
  const int count = g.count;
  CheckBlas(cublasSgemmGroupedBatched(
                H(blas_), g.ta.data(), g.tb.data(), g.m.data(), g.n.data(), g.k.data(),
                g.alpha.data(), dev, g.lda.data(), dev + count, g.ldb.data(), g.beta.data(),
                const_cast<float* const*>(dev + 2 * count), g.ldc.data(), count, g.size.data()),
            op);
}

void CudaBackend::AddBias(float* out, const float* bias, int m, int n) {
  if (int64_t{m} * n == 0 || !Ready()) return;
  AddBiasKernel<<<GridFor(int64_t{m} * n), kThreads, 0, S(stream_)>>>(out, bias, m, n);
  CheckLaunch("AddBias");
}

void CudaBackend::BiasGrad(float* dbias, const float* dout, int m, int n) {
  if (n == 0 || !Ready()) return;
  BiasGradKernel<<<(n + 31) / 32, dim3(32, 8), 0, S(stream_)>>>(dbias, dout, m, n);
  CheckLaunch("BiasGrad");
}

void CudaBackend::Add(float* out, const float* a, const float* b, int64_t n) {
  if (n == 0 || !Ready()) return;
  AddKernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(out, a, b, n);
  CheckLaunch("Add");
}

double CudaBackend::SumOfSquares(const float* x, int64_t n) {
  if (n == 0 || !Ready()) return 0;
  const int blocks = std::min(GridFor(n), 1024);
  double* partial = static_cast<double*>(Scratch(kSumOfSquares, sizeof(double) * (blocks + 1)));
  if (partial == nullptr) return 0;
  SumOfSquaresKernel<<<blocks, kThreads, 0, S(stream_)>>>(partial, x, n);
  SumPartialsKernel<<<1, kThreads, 0, S(stream_)>>>(partial + blocks, partial, blocks);
  if (!CheckLaunch("SumOfSquares")) return 0;
  double total = 0;
  if (!CopyToHost(&total, partial + blocks, sizeof(double)).ok()) return 0;
  return total;
}

void CudaBackend::Scale(float* x, float s, int64_t n) {
  if (n == 0 || !Ready()) return;
  ScaleKernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(x, s, n);
  CheckLaunch("Scale");
}

void CudaBackend::AdamW(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  if (n == 0 || !Ready()) return;
  const compute::AdamWConstants k =
      compute::MakeAdamWConstants(lr, beta1, beta2, eps, weight_decay, step);
  AdamWKernel<<<GridFor(n), kThreads, 0, S(stream_)>>>(param, grad, m, v, n, k);
  CheckLaunch("AdamW");
}

}  // namespace pith::cuda
