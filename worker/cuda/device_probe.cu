#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/cuda/device_probe.h"

namespace pith::cuda {
namespace {

absl::Status CudaError(cudaError_t err, const char* what) {
  return absl::UnavailableError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(err)));
}

// RAII device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(size_t bytes) {
    cudaError_t err = cudaMalloc(&ptr_, bytes);
    return err == cudaSuccess ? absl::OkStatus() : CudaError(err, "cudaMalloc");
  }
  float* get() { return static_cast<float*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

// RAII cuBLAS handle.
class CublasHandle {
 public:
  CublasHandle() = default;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  absl::Status Create() {
    cublasStatus_t st = cublasCreate(&handle_);
    if (st != CUBLAS_STATUS_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("cublasCreate: ", cublasGetStatusString(st)));
    }
    return absl::OkStatus();
  }
  cublasHandle_t get() { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace

absl::StatusOr<CudaReport> ProbeCudaDevices() {
  CudaReport report;
  ncclGetVersion(&report.nccl_version);
  cudaError_t err = cudaRuntimeGetVersion(&report.runtime_version);
  if (err != cudaSuccess) return CudaError(err, "cudaRuntimeGetVersion");
  int count = 0;
  err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaError(err, "cudaGetDeviceCount");
  if (count == 0) return absl::UnavailableError("CUDA: no device");
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) return CudaError(err, "cudaGetDeviceProperties");
    report.devices.push_back({i, prop.name, prop.major, prop.minor, prop.totalGlobalMem});
  }
  CublasHandle handle;
  if (handle.Create().ok()) cublasGetVersion(handle.get(), &report.cublas_version);
  return report;
}

absl::Status CheckCublasGemm() {
  constexpr int kM = 4, kN = 3, kK = 5;
  std::vector<float> a(kM * kK), b(kK * kN), c(kM * kN), want(kM * kN, 0.0f);
  for (int i = 0; i < kM * kK; ++i) a[i] = 0.25f * (i % 7) - 0.5f;
  for (int i = 0; i < kK * kN; ++i) b[i] = 0.125f * (i % 5) + 0.1f;
  // Column-major, as cuBLAS expects: C[m, n] = sum_k A[m, k] B[k, n].
  for (int n = 0; n < kN; ++n)
    for (int m = 0; m < kM; ++m)
      for (int k = 0; k < kK; ++k) want[n * kM + m] += a[k * kM + m] * b[n * kK + k];

  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::UnavailableError("CUDA: no device");
  }
  DeviceBuffer da, db, dc;
  RETURN_IF_ERROR(da.Allocate(a.size() * sizeof(float)));
  RETURN_IF_ERROR(db.Allocate(b.size() * sizeof(float)));
  RETURN_IF_ERROR(dc.Allocate(c.size() * sizeof(float)));
  cudaMemcpy(da.get(), a.data(), a.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(db.get(), b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice);
  CublasHandle handle;
  RETURN_IF_ERROR(handle.Create());
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t cs = cublasSgemm(handle.get(), CUBLAS_OP_N, CUBLAS_OP_N, kM, kN, kK, &alpha,
                                  da.get(), kM, db.get(), kK, &beta, dc.get(), kM);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasSgemm: ", cublasGetStatusString(cs)));
  }
  cudaError_t err =
      cudaMemcpy(c.data(), dc.get(), c.size() * sizeof(float), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return CudaError(err, "cudaMemcpy");
  for (size_t i = 0; i < c.size(); ++i) {
    if (std::fabs(c[i] - want[i]) > 1e-4f) {
      return absl::InternalError(
          absl::StrCat("cuBLAS result ", i, " is ", c[i], ", want ", want[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace pith::cuda
