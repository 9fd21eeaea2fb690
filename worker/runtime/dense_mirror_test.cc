// DenseMirror on a backend the host may not touch (OpaqueBackend: a direct read crashes)
// and on the CPU's (no copies: the backend's own pointers come back).
#include "worker/runtime/dense_mirror.h"

#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/compute/opaque_backend.h"

namespace pith::runtime {
namespace {

TEST(DenseMirrorTest, CopiesOnlyWhereTheHostCannotReach) {
  compute::OpaqueBackend opaque(1);
  constexpr int64_t kFloats = 1000;
  auto params = opaque.Allocate(kFloats * sizeof(float));
  ASSERT_TRUE(params.ok());
  std::vector<float> host(kFloats);
  for (int64_t i = 0; i < kFloats; ++i) host[i] = 0.25f * static_cast<float>(i);
  ASSERT_TRUE(opaque.CopyToDevice(params->data(), host.data(), kFloats * sizeof(float)).ok());

  DenseMirror mirror(&opaque, kFloats);
  EXPECT_TRUE(mirror.on());
  absl::StatusOr<const float*> read = mirror.Host(DenseMirror::kParams, params->f32());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_NE(*read, params->f32());
  EXPECT_EQ(std::vector<float>(*read, *read + kFloats), host);

  // A fetch lands in the copy, then goes to the device.
  float* landing = mirror.Landing(DenseMirror::kMomentM, params->f32());
  EXPECT_NE(landing, params->f32());
  for (int64_t i = 0; i < kFloats; ++i) landing[i] = -1.0f * static_cast<float>(i);
  ASSERT_TRUE(mirror.Upload(DenseMirror::kMomentM, params->f32()).ok());
  std::vector<float> back(kFloats);
  ASSERT_TRUE(opaque.CopyToHost(back.data(), params->data(), kFloats * sizeof(float)).ok());
  EXPECT_EQ(back, std::vector<float>(landing, landing + kFloats));

  // A group of one: the all-reduce leaves the sum (itself) on the device.
  auto peers = PeerGroup::Create();
  ASSERT_TRUE(peers.ok()) << peers.status();
  ASSERT_TRUE((*peers)->Join(0, {(*peers)->address()}, 1).ok());
  ASSERT_TRUE(mirror.AllReduceSum(**peers, params->f32(), 5).ok());
  ASSERT_TRUE(opaque.CopyToHost(back.data(), params->data(), kFloats * sizeof(float)).ok());
  EXPECT_EQ(back, std::vector<float>(landing, landing + kFloats));

  compute::CpuBackend cpu(1);
  DenseMirror none(&cpu, kFloats);
  EXPECT_FALSE(none.on());
  EXPECT_EQ(*none.Host(DenseMirror::kGrads, host.data()), host.data());
  EXPECT_EQ(none.Landing(DenseMirror::kParams, host.data()), host.data());
  EXPECT_TRUE(none.Upload(DenseMirror::kParams, host.data()).ok());
}

}  // namespace
}  // namespace pith::runtime
