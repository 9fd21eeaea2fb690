// The CUDA backend's plugin interface. The backend, with cuBLAS, cuBLASLt and NCCL, is a
// shared module (libpith_cuda_backend.so, beside pith-worker) that backend_select loads
// with dlopen only when a worker trains on a GPU: linked into pith-worker, those libraries
// cost every worker ~155 MB of resident memory at start, GPU or not (their code and data,
// touched as the loader maps and relocates them), which a worker bounded by
// --memory_bytes cannot spare.
//
// The module exports two C functions. Their C++ arguments are only safe between a
// pith-worker and a module built from the same compute interface, so the module also
// says which one it was built against (PITH_BACKEND_ABI, a hash of worker/compute/backend.h
// and common/compute_dtype.h; other headers, Abseil's, are taken to come from the same
// build) and the loader refuses any other.
#ifndef PITH_WORKER_BACKEND_CUDA_PLUGIN_H_
#define PITH_WORKER_BACKEND_CUDA_PLUGIN_H_

#include <cstddef>

#include "worker/compute/backend.h"

namespace pith::compute {

inline constexpr char kCudaPluginFile[] = "libpith_cuda_backend.so";
inline constexpr char kCudaPluginAbiSymbol[] = "PithCudaPluginAbi";
inline constexpr char kCudaPluginCreateSymbol[] = "PithCudaPluginCreate";

// PITH_BACKEND_ABI of the module's build.
using CudaPluginAbiFn = const char* (*)();
// Makes the CUDA backend on `device`. Returns 0 with the backend in *out (the caller owns
// it) and its description in `text`; otherwise an absl::StatusCode, with the reason in
// `text` (NUL-terminated, cut to text_size).
using CudaPluginCreateFn = int (*)(int device, Backend** out, char* text, size_t text_size);

}  // namespace pith::compute

#endif  // PITH_WORKER_BACKEND_CUDA_PLUGIN_H_
