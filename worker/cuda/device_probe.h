// What the CUDA backend can see on this machine: devices, cuBLAS and NCCL. The worker's
// --backend=auto picks CUDA only when ProbeCudaDevices() finds a device.
//
// Thread safety: ProbeCudaDevices() may be called from any thread.
#ifndef PITH_WORKER_CUDA_DEVICE_PROBE_H_
#define PITH_WORKER_CUDA_DEVICE_PROBE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pith::cuda {

struct CudaDevice {
  int ordinal = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  size_t total_memory_bytes = 0;
};

struct CudaReport {
  int runtime_version = 0;  // e.g. 13000
  int nccl_version = 0;     // e.g. 22800
  int cublas_version = 0;   // e.g. 130000; 0 when no device let cuBLAS start
  std::vector<CudaDevice> devices;
};

// Lists the CUDA devices and the library versions. UNAVAILABLE (with the CUDA error text)
// when the driver or a device is missing; never aborts.
absl::StatusOr<CudaReport> ProbeCudaDevices();

// Multiplies two small matrices with cuBLAS on device 0 and checks the result against
// the host: the whole path host -> device -> cuBLAS -> host works. UNAVAILABLE without a
// device, INTERNAL on a wrong result.
absl::Status CheckCublasGemm();

}  // namespace pith::cuda

#endif  // PITH_WORKER_CUDA_DEVICE_PROBE_H_
