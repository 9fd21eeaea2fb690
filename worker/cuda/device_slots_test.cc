// DeviceSlots: uploads land in their slots, a compute stream ordered after an upload sees
// its bytes, a download reads what the compute wrote before it, bad slots and sizes are
// refused, and uploads overlap the compute stream's work. Skipped without a CUDA device (the
// argument checks run everywhere).
#include "worker/cuda/device_slots.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "worker/cuda/cuda_backend.h"

namespace pith::cuda {
namespace {

TEST(DeviceSlotsArgs, NoSlotsOrEmptySlotsAreRefused) {
  EXPECT_EQ(DeviceSlots::Create(0, 1024, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceSlots::Create(0, 0, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

// Page-aligned host memory, freed on scope exit.
struct HostBuffer {
  explicit HostBuffer(size_t bytes) : bytes(bytes) {
    ptr = static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  }
  ~HostBuffer() { std::free(ptr); }
  uint8_t* ptr;
  size_t bytes;
};

class DeviceSlotsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = CudaBackend::Create(0);
    if (!backend.ok()) GTEST_SKIP() << "no CUDA device here: " << backend.status();
    backend_ = std::move(*backend);
  }
  std::unique_ptr<CudaBackend> backend_;
};

TEST_F(DeviceSlotsTest, UploadsLandInTheirSlotsAndAreOrderedBeforeCompute) {
  constexpr size_t kSlot = 8 << 20;
  constexpr int kSlots = 4;
  HostBuffer staging(kSlot * kSlots);  // outlives the slots, which unregister it
  auto slots = DeviceSlots::Create(0, kSlot, kSlots);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_TRUE((*slots)->RegisterStaging(staging.ptr, staging.bytes).ok());
  for (size_t i = 0; i < staging.bytes; ++i)
    staging.ptr[i] = static_cast<uint8_t>(i * 7 + i / kSlot);
  // Slot i gets staging part (kSlots - 1 - i); the compute stream reads each after
  // MakeVisible, with no host wait in between.
  std::vector<uint8_t> back(kSlot);
  for (int i = 0; i < kSlots; ++i) {
    const uint8_t* src = staging.ptr + kSlot * (kSlots - 1 - i);
    ASSERT_TRUE((*slots)->Upload(i, src, kSlot).ok());
    ASSERT_TRUE((*slots)->MakeVisible(i, backend_->stream()).ok());
    ASSERT_TRUE(backend_->CopyToHost(back.data(), (*slots)->slot(i), kSlot).ok());
    ASSERT_EQ(0, std::memcmp(back.data(), src, kSlot)) << "slot " << i;
  }
  EXPECT_EQ((*slots)->Upload(kSlots, staging.ptr, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*slots)->Upload(0, staging.ptr, kSlot + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*slots)->MakeVisible(-1, backend_->stream()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*slots)->Release(kSlots, backend_->stream()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*slots)->Wait().ok());
}

TEST_F(DeviceSlotsTest, UploadsOverlapCompute) {
  // ~1 GiB of uploads against a chain of 4096^3 fp32 products on the compute stream.
  constexpr size_t kSlot = 64 << 20;
  constexpr int kSlots = 16;
  HostBuffer staging(kSlot * kSlots);
  auto slots = DeviceSlots::Create(0, kSlot, kSlots);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_TRUE((*slots)->RegisterStaging(staging.ptr, staging.bytes).ok());
  std::memset(staging.ptr, 1, staging.bytes);
  constexpr int n = 4096;
  auto a = backend_->Allocate(sizeof(float) * n * n), c = backend_->Allocate(sizeof(float) * n * n);
  ASSERT_TRUE(a.ok() && c.ok());
  auto seconds = [](auto&& body) {
    const auto start = std::chrono::steady_clock::now();
    body();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto compute = [&] {
    for (int i = 0; i < 12; ++i) {
      backend_->Gemm(false, false, n, n, n, 1.0f, a->f32(), n, a->f32(), n, 0.0f, c->f32(), n);
    }
  };
  auto upload = [&] {
    for (int i = 0; i < kSlots; ++i) {
      ASSERT_TRUE((*slots)->Upload(i, staging.ptr + kSlot * i, kSlot).ok());
    }
  };
  compute();  // warm-up
  upload();
  ASSERT_TRUE(backend_->Synchronize().ok() && (*slots)->Wait().ok());
  const double t_compute = seconds([&] {
    compute();
    ASSERT_TRUE(backend_->Synchronize().ok());
  });
  const double t_upload = seconds([&] {
    upload();
    ASSERT_TRUE((*slots)->Wait().ok());
  });
  const double t_both = seconds([&] {
    upload();
    compute();
    ASSERT_TRUE(backend_->Synchronize().ok() && (*slots)->Wait().ok());
  });
  std::printf("compute %.1f ms, uploads %.1f ms (%.1f GB/s), both %.1f ms\n", t_compute * 1e3,
              t_upload * 1e3, kSlot * kSlots / t_upload / 1e9, t_both * 1e3);
  // Serialized, both would take the sum; overlapped, close to the longer of the two.
  EXPECT_LT(t_both, 0.85 * (t_compute + t_upload));
}

TEST_F(DeviceSlotsTest, ReleaseKeepsAnUploadFromOverwritingASlotStillBeingRead) {
  // The compute stream is busy with a chain of products, then reads slot 0 (a copy out);
  // an upload into slot 0 issued after Release must wait for that read.
  constexpr size_t kSlot = 64 << 20;
  HostBuffer staging(2 * kSlot);
  auto slots = DeviceSlots::Create(0, kSlot, 1);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_TRUE((*slots)->RegisterStaging(staging.ptr, staging.bytes).ok());
  std::memset(staging.ptr, 0x11, kSlot);
  std::memset(staging.ptr + kSlot, 0x22, kSlot);
  constexpr int n = 4096;
  auto a = backend_->Allocate(sizeof(float) * n * n), c = backend_->Allocate(sizeof(float) * n * n);
  auto out = backend_->Allocate(kSlot);
  ASSERT_TRUE(a.ok() && c.ok() && out.ok());
  ASSERT_TRUE((*slots)->Upload(0, staging.ptr, kSlot).ok());
  ASSERT_TRUE((*slots)->MakeVisible(0, backend_->stream()).ok());
  for (int i = 0; i < 12; ++i) {
    backend_->Gemm(false, false, n, n, n, 1.0f, a->f32(), n, a->f32(), n, 0.0f, c->f32(), n);
  }
  ASSERT_EQ(cudaMemcpyAsync(out->data(), (*slots)->slot(0), kSlot, cudaMemcpyDeviceToDevice,
                            backend_->stream()),
            cudaSuccess);
  ASSERT_TRUE((*slots)->Release(0, backend_->stream()).ok());
  ASSERT_TRUE((*slots)->Upload(0, staging.ptr + kSlot, kSlot).ok());
  ASSERT_TRUE((*slots)->Wait().ok());
  std::vector<uint8_t> read(kSlot), now(kSlot);
  ASSERT_TRUE(backend_->CopyToHost(read.data(), out->data(), kSlot).ok());
  ASSERT_TRUE(backend_->CopyToHost(now.data(), (*slots)->slot(0), kSlot).ok());
  EXPECT_EQ(0, std::memcmp(read.data(), staging.ptr, kSlot)) << "the read saw the next upload";
  EXPECT_EQ(0, std::memcmp(now.data(), staging.ptr + kSlot, kSlot));
}

TEST_F(DeviceSlotsTest, ADownloadWaitsForTheComputeThatWroteTheSlotAndBlocksTheNextWriter) {
  // The compute stream is busy with a chain of products, then writes slot 0 (a copy in);
  // a download issued after Release must read what it wrote, and a write ordered after
  // the download (MakeVisible) must not overtake it.
  constexpr size_t kSlot = 64 << 20;
  HostBuffer host(kSlot);
  auto slots = DeviceSlots::Create(0, kSlot, 1);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_TRUE((*slots)->RegisterStaging(host.ptr, host.bytes).ok());
  std::memset(host.ptr, 0, kSlot);
  constexpr int n = 4096;
  auto a = backend_->Allocate(sizeof(float) * n * n), c = backend_->Allocate(sizeof(float) * n * n);
  auto first = backend_->Allocate(kSlot), second = backend_->Allocate(kSlot);
  ASSERT_TRUE(a.ok() && c.ok() && first.ok() && second.ok());
  ASSERT_EQ(cudaMemset(first->data(), 0x33, kSlot), cudaSuccess);
  ASSERT_EQ(cudaMemset(second->data(), 0x44, kSlot), cudaSuccess);
  ASSERT_TRUE(backend_->Synchronize().ok());
  for (int i = 0; i < 12; ++i) {
    backend_->Gemm(false, false, n, n, n, 1.0f, a->f32(), n, a->f32(), n, 0.0f, c->f32(), n);
  }
  ASSERT_EQ(cudaMemcpyAsync((*slots)->slot(0), first->data(), kSlot, cudaMemcpyDeviceToDevice,
                            backend_->stream()),
            cudaSuccess);
  ASSERT_TRUE((*slots)->Release(0, backend_->stream()).ok());
  ASSERT_TRUE((*slots)->Download(0, host.ptr, kSlot).ok());
  ASSERT_TRUE((*slots)->MakeVisible(0, backend_->stream()).ok());
  ASSERT_EQ(cudaMemcpyAsync((*slots)->slot(0), second->data(), kSlot, cudaMemcpyDeviceToDevice,
                            backend_->stream()),
            cudaSuccess);
  ASSERT_TRUE((*slots)->WaitSlot(0).ok());
  const std::vector<uint8_t> want(kSlot, 0x33);
  // Zeros: it ran before the first write; 0x44: the second write overtook it.
  EXPECT_EQ(0, std::memcmp(host.ptr, want.data(), kSlot)) << "the download read another write";
  ASSERT_TRUE(backend_->Synchronize().ok());
}

}  // namespace
}  // namespace pith::cuda
