#include "worker/backend/backend_select.h"

#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "worker/backend/cuda_plugin.h"
#include "worker/compute/cpu_backend.h"

namespace pith::compute {
namespace {

#ifdef PITH_WITH_CUDA
// The CUDA backend's module, loaded once (never unloaded: the backends it makes live on),
// or why it could not be.
struct CudaPlugin {
  CudaPluginCreateFn create = nullptr;
  absl::Status status;
};

CudaPlugin Load() {
  CudaPlugin plugin;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) {
    plugin.status = absl::FailedPreconditionError(absl::StrCat(
        "cannot find the CUDA backend (", kCudaPluginFile, "): /proc/self/exe: ", error.message()));
    return plugin;
  }
  const std::string path = (exe.parent_path() / kCudaPluginFile).string();
  void* module = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (module == nullptr) {
    const char* why = ::dlerror();
    plugin.status =
        absl::FailedPreconditionError(absl::StrCat("cannot load the CUDA backend ", path,
                                                   " (it must sit beside the binary, with CUDA's "
                                                   "libraries on the loader's path): ",
                                                   why != nullptr ? why : "unknown error"));
    return plugin;
  }
  auto abi = reinterpret_cast<CudaPluginAbiFn>(::dlsym(module, kCudaPluginAbiSymbol));
  auto create = reinterpret_cast<CudaPluginCreateFn>(::dlsym(module, kCudaPluginCreateSymbol));
  if (abi == nullptr || create == nullptr) {
    plugin.status =
        absl::FailedPreconditionError(absl::StrCat(path, " is not Pith's CUDA backend"));
  } else if (absl::string_view(abi()) != PITH_BACKEND_ABI) {
    plugin.status = absl::FailedPreconditionError(
        absl::StrCat(path, " was built against another compute interface (", abi(),
                     ", this binary's is ", PITH_BACKEND_ABI, "): install both from one build"));
  }
  if (!plugin.status.ok()) {
    ::dlclose(module);
    return plugin;
  }
  plugin.create = create;
  return plugin;
}

const CudaPlugin& LoadedCudaPlugin() {
  static const CudaPlugin* plugin = new CudaPlugin(Load());  // thread-safe, once
  return *plugin;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, std::string* description) {
  const CudaPlugin& plugin = LoadedCudaPlugin();
  if (!plugin.status.ok()) return plugin.status;
  Backend* backend = nullptr;
  char text[512] = "";
  const int code = plugin.create(device, &backend, text, sizeof(text));
  if (code != 0 || backend == nullptr) {
    return absl::Status(
        code != 0 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kInternal,
        code != 0 ? text : "the CUDA backend made no backend");
  }
  if (description != nullptr) *description = absl::StrCat("cuda: ", text);
  return std::unique_ptr<Backend>(backend);
}
#endif

}  // namespace

bool HostHasNvidiaDriver() {
  return ::access("/dev/nvidiactl", F_OK) == 0 || ::access("/proc/driver/nvidia", F_OK) == 0 ||
         ::access("/dev/dxg", F_OK) == 0;
}

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
  std::string why_not_cuda;  // auto on a host with NVIDIA's driver that took the CPU
#ifdef PITH_WITH_CUDA
  if (choice.kind == "cuda" || (choice.kind == "auto" && HostHasNvidiaDriver())) {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeCudaBackend(choice.device, description);
    if (gpu.ok() || choice.kind == "cuda") return gpu;
    why_not_cuda = absl::StrCat(" (not CUDA: ", gpu.status().message(), ")");
  }
#endif
  auto cpu = std::make_unique<CpuBackend>(choice.threads);
  if (description != nullptr) {
    *description = absl::StrCat("cpu: OpenBLAS ", BlasCoreName(), " kernels", why_not_cuda);
  }
  return std::unique_ptr<Backend>(std::move(cpu));
}

}  // namespace pith::compute
