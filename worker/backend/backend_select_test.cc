// Backend selection: the flag values, and what each gives on this machine.
#include "worker/backend/backend_select.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/backend/cuda_plugin.h"

namespace pith::compute {
namespace {

std::string MappedFiles() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream all;
  all << maps.rdbuf();
  return all.str();
}

// Exits 0 when, after choosing the CPU (and auto, where the host has no NVIDIA driver),
// none of CUDA's libraries is mapped; else 1, naming it.
void ChooseTheCpuAndExit() {
  if (!MakeBackend({"cpu", 0, 1}).ok()) std::exit(2);
  // With a driver, auto loads them.
  if (!HostHasNvidiaDriver() && !MakeBackend({"auto", 0, 1}).ok()) std::exit(2);
  const std::string maps = MappedFiles();
  for (const char* lib : {"libcublas", "libcudart", "libnccl", "libpith_cuda_backend"}) {
    if (maps.find(lib) != std::string::npos) {
      std::fprintf(stderr, "%s is mapped\n", lib);
      std::exit(1);
    }
  }
  std::exit(0);
}

// A worker that trains on the CPU never maps CUDA's libraries (~155 MB resident at load:
// cuda_plugin.h). In a process of its own (the threadsafe death-test style runs the test
// binary afresh): the CUDA test below loads them for good.
TEST(BackendSelectDeathTest, TheCpuPathLoadsNoCudaLibrary) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(ChooseTheCpuAndExit(), ::testing::ExitedWithCode(0), "");
}

TEST(BackendSelectTest, CpuAndBadValues) {
  std::string description;
  absl::StatusOr<std::unique_ptr<Backend>> cpu = MakeBackend({"cpu", 0, 1}, &description);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->name(), "cpu");
  EXPECT_EQ(description.rfind("cpu: ", 0), 0u) << description;
  EXPECT_EQ(MakeBackend({"tpu", 0, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeBackend({"cpu", -1, 1}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BackendSelectTest, CudaIsExplicitAndAutoFallsBack) {
  absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeBackend({"cuda", 0, 1});
  absl::StatusOr<std::unique_ptr<Backend>> any = MakeBackend({"auto", 0, 1});
  ASSERT_TRUE(any.ok()) << any.status();
  if (!CudaBuiltIn()) {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*any)->name(), "cpu");
    return;
  }
  if (cuda.ok()) {
    EXPECT_EQ((*cuda)->name(), "cuda");
    EXPECT_EQ((*any)->name(), "cuda");
  } else {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable) << cuda.status();
    EXPECT_EQ((*any)->name(), "cpu");
  }
  // A device this host does not have.
  EXPECT_EQ(MakeBackend({"cuda", 4096, 1}).status().code(), absl::StatusCode::kUnavailable);
}

// What a worker installed without its module, or beside a file of that name that is not
// one, is told (run by the test below, from a copy of this binary; skipped otherwise):
// `cuda` fails naming the file and why, `auto` falls back to the CPU.
TEST(BackendSelectTest, ModuleCheckedFromACopy) {
  const char* want = std::getenv("PITH_TEST_MODULE_WANT");
  if (want == nullptr) GTEST_SKIP() << "run from a copy by ModuleMissingOrForeignIsNamed";
  absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeBackend({"cuda", 0, 1});
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition) << cuda.status();
  EXPECT_NE(cuda.status().message().find(want), absl::string_view::npos) << cuda.status();
  EXPECT_NE(cuda.status().message().find(kCudaPluginFile), absl::string_view::npos);
  absl::StatusOr<std::unique_ptr<Backend>> any = MakeBackend({"auto", 0, 1});
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ((*any)->name(), "cpu");
}

// Runs ModuleCheckedFromACopy from a copy of this binary in a folder of its own, with
// `module` (a path; empty: none) copied beside it under the module's name. True when it
// passed.
bool RunCopy(const std::string& module, const std::string& want) {
  std::string dir_template = ::testing::TempDir() + "pith-module-XXXXXX";
  const char* dir = ::mkdtemp(dir_template.data());
  if (dir == nullptr) return false;
  const std::filesystem::path folder(dir);
  std::error_code ec;
  std::filesystem::copy_file(std::filesystem::read_symlink("/proc/self/exe"), folder / "copy", ec);
  if (!ec && !module.empty()) std::filesystem::copy_file(module, folder / kCudaPluginFile, ec);
  bool passed = false;
  if (!ec) {
    ::setenv("PITH_TEST_MODULE_WANT", want.c_str(), 1);  // the child's, not this test's
    const std::string command =
        absl::StrCat("'", (folder / "copy").string(),
                     "' --gtest_filter=BackendSelectTest.ModuleCheckedFromACopy");
    const int rc = std::system(command.c_str());
    ::unsetenv("PITH_TEST_MODULE_WANT");
    passed = rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
  }
  std::filesystem::remove_all(folder, ec);
  return passed;
}

TEST(BackendSelectTest, ModuleMissingOrForeignIsNamed) {
  if (!CudaBuiltIn()) GTEST_SKIP() << "no CUDA backend in this build: nothing is loaded";
  EXPECT_TRUE(RunCopy("", "cannot load the CUDA backend")) << "the module missing";
  // A shared object that is not Pith's module: one this binary maps, without side effects
  // when loaded twice.
  std::string foreign;
  for (const char* name : {"/libz.so", "/libgcc_s.so"}) {
    std::istringstream maps(MappedFiles());
    for (std::string line; foreign.empty() && std::getline(maps, line);) {
      const size_t at = line.find('/');
      if (at != std::string::npos && line.find(name) != std::string::npos)
        foreign = line.substr(at);
    }
  }
  if (foreign.empty()) GTEST_SKIP() << "no libz or libgcc_s mapped here to stand in";
  EXPECT_TRUE(RunCopy(foreign, "is not Pith's CUDA backend")) << "beside " << foreign;
}

}  // namespace
}  // namespace pith::compute
