// The entry points of libpith_cuda_backend.so (worker/backend/cuda_plugin.h).
#include "worker/backend/cuda_plugin.h"

#include <cstdio>
#include <exception>
#include <memory>
#include <type_traits>

#include "worker/cuda/cuda_backend.h"

namespace {

void Put(absl::string_view s, char* text, size_t text_size) {
  if (text_size == 0) return;
  std::snprintf(text, text_size, "%.*s", static_cast<int>(s.size()), s.data());
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const char* PithCudaPluginAbi() {
  return PITH_BACKEND_ABI;
}

// No exception crosses the module's C boundary: one thrown while the backend is made
// (std::bad_alloc) is the loader's INTERNAL error, with its text.
extern "C" __attribute__((visibility("default"))) int PithCudaPluginCreate(
    int device, pith::compute::Backend** out, char* text, size_t text_size) {
  try {
    absl::StatusOr<std::unique_ptr<pith::cuda::CudaBackend>> gpu =
        pith::cuda::CudaBackend::Create(device);
    if (!gpu.ok()) {
      Put(gpu.status().message(), text, text_size);
      return static_cast<int>(gpu.status().code());
    }
    Put((*gpu)->description(), text, text_size);
    *out = gpu->release();
    return 0;
  } catch (const std::exception& e) {
    Put(e.what(), text, text_size);
  } catch (...) {
    Put("an unknown exception", text, text_size);
  }
  return static_cast<int>(absl::StatusCode::kInternal);
}

// The module's functions must match the types the loader casts them to.
static_assert(std::is_same_v<decltype(&PithCudaPluginAbi), pith::compute::CudaPluginAbiFn>);
static_assert(std::is_same_v<decltype(&PithCudaPluginCreate), pith::compute::CudaPluginCreateFn>);
