// What the CUDA backend's tests share: random inputs, the closeness check against the CPU
// backend, bf16 rounding of host vectors, and a fixture with a CudaBackend on device 0
// (skipped without one) and host <-> device copies. Tests only.
#ifndef PITH_WORKER_CUDA_CUDA_TEST_SUPPORT_H_
#define PITH_WORKER_CUDA_CUDA_TEST_SUPPORT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/cuda/cuda_backend.h"

namespace pith::cuda::testing_support {

using Vec = std::vector<float>;
using Ints = std::vector<int32_t>;

inline constexpr double kRelative = 1e-5;

inline Vec Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  Vec v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// |got - want| <= rel * (|want| + rms(want)) for every element (the two sum in different
// orders: the error scales with the data, not with each element).
inline void ExpectClose(const char* what, const Vec& got, const Vec& want, double rel = kRelative) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double rms = 0;
  for (float w : want) rms += double{w} * w;
  rms = std::sqrt(rms / std::max<size_t>(1, want.size()));
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 5; ++i) {
    const double tol = rel * (std::fabs(want[i]) + rms) + 1e-30;
    if (!(std::fabs(double{got[i]} - want[i]) <= tol)) {  // NaN fails too
      ADD_FAILURE() << what << "[" << i << "]: cuda " << got[i] << " cpu " << want[i];
      ++bad;
    }
  }
}

// A host vector in bf16 (nearest even): the bits, and their fp32 values.
struct Bf16Vec {
  Vec rounded;
  std::vector<uint16_t> bits;
};
inline Bf16Vec ToBf16(const Vec& v) {
  Bf16Vec out;
  for (float x : v) {
    out.bits.push_back(RoundToBf16(x));
    out.rounded.push_back(Bf16ToFloat(out.bits.back()));
  }
  return out;
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<CudaBackend>> gpu = CudaBackend::Create(0);
    if (!gpu.ok()) GTEST_SKIP() << "no CUDA device here: " << gpu.status();
    gpu_ = std::move(*gpu);
  }

  // A device copy of `host`, kept alive by the fixture.
  template <typename T>
  T* Up(const std::vector<T>& host) {
    absl::StatusOr<compute::DeviceBuffer> buf =
        gpu_->Allocate(std::max<size_t>(1, host.size()) * sizeof(T));
    EXPECT_TRUE(buf.ok()) << buf.status();
    EXPECT_TRUE(gpu_->CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T)).ok());
    buffers_.push_back(std::move(*buf));
    return static_cast<T*>(buffers_.back().data());
  }
  template <typename T>
  std::vector<T> Down(const T* dev, size_t n) {
    std::vector<T> host(n);
    absl::Status st = gpu_->CopyToHost(host.data(), dev, n * sizeof(T));
    EXPECT_TRUE(st.ok()) << st;
    return host;
  }

  compute::CpuBackend cpu_{1};
  std::unique_ptr<CudaBackend> gpu_;
  std::vector<compute::DeviceBuffer> buffers_;
};

}  // namespace pith::cuda::testing_support

#endif  // PITH_WORKER_CUDA_CUDA_TEST_SUPPORT_H_
