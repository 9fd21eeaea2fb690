// Backend selection: the flag values, and what each gives on this machine.
#include "worker/backend/backend_select.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace pith::compute
