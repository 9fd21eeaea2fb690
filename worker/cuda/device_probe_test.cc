// Runs everywhere: without a device the probe must say UNAVAILABLE (not crash); with one
// it must list it and cuBLAS must compute a correct product.
#include "worker/cuda/device_probe.h"

#include "gtest/gtest.h"

namespace pith::cuda {
namespace {

TEST(DeviceProbeTest, ReportsDevicesOrUnavailable) {
  absl::StatusOr<CudaReport> report = ProbeCudaDevices();
  if (!report.ok()) {
    EXPECT_EQ(report.status().code(), absl::StatusCode::kUnavailable) << report.status();
    EXPECT_EQ(CheckCublasGemm().code(), absl::StatusCode::kUnavailable);
    GTEST_SKIP() << "no CUDA device here: " << report.status();
  }
  ASSERT_FALSE(report->devices.empty());
  EXPECT_GT(report->runtime_version, 0);
  EXPECT_GT(report->nccl_version, 0);
  for (const CudaDevice& d : report->devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GE(d.compute_major, 7);
    EXPECT_GT(d.total_memory_bytes, 0u);
  }
  EXPECT_TRUE(CheckCublasGemm().ok()) << CheckCublasGemm();
}

}  // namespace
}  // namespace pith::cuda
