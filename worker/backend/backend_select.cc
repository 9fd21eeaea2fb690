#include "worker/backend/backend_select.h"

#include "absl/strings/str_cat.h"
#include "worker/compute/cpu_backend.h"
#ifdef PITH_WITH_CUDA
#include "worker/cuda/cuda_backend.h"
#endif

namespace pith::compute {

bool CudaBuiltIn() {
#ifdef PITH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendChoice& choice,
                                                     std::string* description) {
  if (choice.kind != "cpu" && choice.kind != "cuda" && choice.kind != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", choice.kind, ": expected cpu, cuda or auto"));
  }
  if (choice.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--device=", choice.device, ": must be >= 0"));
  }
  if (choice.kind == "cuda" && !CudaBuiltIn()) {
    return absl::FailedPreconditionError(
        "--backend=cuda: this build has no CUDA backend (built without nvcc, or with "
        "-DPITH_CUDA=OFF)");
  }
#ifdef PITH_WITH_CUDA
  if (choice.kind != "cpu") {
    absl::StatusOr<std::unique_ptr<cuda::CudaBackend>> gpu =
        cuda::CudaBackend::Create(choice.device);
    if (gpu.ok()) {
      if (description != nullptr) *description = absl::StrCat("cuda: ", (*gpu)->description());
      return std::unique_ptr<Backend>(std::move(*gpu));
    }
    if (choice.kind == "cuda") return gpu.status();
  }
#endif
  auto cpu = std::make_unique<CpuBackend>(choice.threads);
  if (description != nullptr) {
    *description = absl::StrCat("cpu: OpenBLAS ", BlasCoreName(), " kernels");
  }
  return std::unique_ptr<Backend>(std::move(cpu));
}

}  // namespace pith::compute
