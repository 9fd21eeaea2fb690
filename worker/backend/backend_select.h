// Picks a worker's compute backend from --backend and --device: "cpu", "cuda" (device N;
// an error when this build has no CUDA or the host no such device) or "auto" (CUDA when
// the build has it and the device exists, else CPU). The CUDA backend is a module loaded
// on first use (cuda_plugin.h); auto loads it only on a host with NVIDIA's driver.
//
// Thread safety: MakeBackend may be called from any thread.
#ifndef PITH_WORKER_BACKEND_BACKEND_SELECT_H_
#define PITH_WORKER_BACKEND_BACKEND_SELECT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/compute/backend.h"

namespace pith::compute {

struct BackendChoice {
  std::string kind = "cpu";  // cpu | cuda | auto
  int device = 0;            // CUDA device ordinal
  int threads = 0;           // CPU backend threads (0 = one per core)
};

// Whether this build has the CUDA backend.
bool CudaBuiltIn();

// Whether the host has NVIDIA's driver (WSL2's GPU device included): without it
// --backend=auto picks the CPU without loading the CUDA backend's libraries at all.
bool HostHasNvidiaDriver();

// The backend named by `choice`, with a line saying what was picked in `description`
// ("cuda: NVIDIA H200 (sm_90, 139 GiB)", "cpu: 16 threads"). INVALID_ARGUMENT for an
// unknown kind; FAILED_PRECONDITION for cuda in a build without CUDA; UNAVAILABLE for
// cuda without the device.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendChoice& choice,
                                                     std::string* description = nullptr);

}  // namespace pith::compute

#endif  // PITH_WORKER_BACKEND_BACKEND_SELECT_H_
