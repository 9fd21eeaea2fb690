// JoinDeviceGroup over a real PeerGroup (UCX loopback) with OpaqueBackend's device group:
// every rank joins and the sums are the rank-order sums; when one rank cannot join, no
// rank uses a group; a CPU backend has none. The group's deadline and abort end a sum a
// peer never joins.
#include "worker/runtime/device_group.h"

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/compute/opaque_backend.h"
#include "worker/runtime/peer_group_testing.h"

namespace pith::runtime {
namespace {

// An OpaqueBackend whose joins fail (a second worker on the same GPU, as NCCL sees it).
class NoJoinBackend : public compute::OpaqueBackend {
 public:
  absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> JoinGroup(const std::string&, int, int,
                                                                  absl::Duration) override {
    return absl::InvalidArgumentError("duplicate GPU");
  }
};

// Runs `body(rank)` on one thread per rank.
void OnEveryRank(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

TEST(DeviceGroupTest, EveryRankJoinsAndSumsInRankOrder) {
  constexpr int kRanks = 3;
  auto peers = JoinedPeerGroups(kRanks);
  OnEveryRank(kRanks, [&](int r) {
    compute::OpaqueBackend backend(1);
    auto group = JoinDeviceGroup(backend, *peers[r], absl::Seconds(10));
    ASSERT_TRUE(group.ok()) << group.status();
    ASSERT_NE(*group, nullptr);
    auto buffer = backend.Allocate(4 * sizeof(float));
    ASSERT_TRUE(buffer.ok());
    const std::vector<float> mine = {1.0f * r, 0.5f, 1e8f * (r == 0), 1.0f * (r == 2)};
    ASSERT_TRUE(backend.CopyToDevice(buffer->data(), mine.data(), 4 * sizeof(float)).ok());
    for (int round = 0; round < 2; ++round) {  // a second sum starts from the first's
      ASSERT_TRUE((*group)->AllReduceSum(buffer->f32(), 4, absl::Seconds(10)).ok());
    }
    std::vector<float> sum(4);
    ASSERT_TRUE(backend.CopyToHost(sum.data(), buffer->data(), 4 * sizeof(float)).ok());
    EXPECT_EQ(sum, std::vector<float>({9.0f, 4.5f, 3e8f, 3.0f}));
  });
}

TEST(DeviceGroupTest, OneRankThatCannotJoinLeavesEveryRankOnThePeerGroup) {
  auto peers = JoinedPeerGroups(2);
  OnEveryRank(2, [&](int r) {
    std::unique_ptr<compute::Backend> backend;
    if (r == 1) {
      backend = std::make_unique<NoJoinBackend>();
    } else {
      backend = std::make_unique<compute::OpaqueBackend>(1);
    }
    // Rank 0's join waits for rank 1 until its deadline: short here.
    auto group = JoinDeviceGroup(*backend, *peers[r], absl::Milliseconds(300));
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ(*group, nullptr) << "rank " << r;
  });
  // A backend reading host memory has none, whatever the world.
  compute::CpuBackend cpu(1);
  auto group = JoinDeviceGroup(cpu, *peers[0], absl::Seconds(1));
  ASSERT_TRUE(group.ok());
  EXPECT_EQ(*group, nullptr);
}

TEST(DeviceGroupTest, ASumAPeerNeverJoinsEndsAtItsDeadlineOrAnAbort) {
  compute::OpaqueBackend a(1), b(1);
  auto id = a.NewGroupId();
  ASSERT_TRUE(id.ok());
  std::unique_ptr<compute::DeviceGroup> ga, gb;
  OnEveryRank(2, [&](int r) {
    auto joined = (r == 0 ? a : b).JoinGroup(*id, r, 2, absl::Seconds(10));
    ASSERT_TRUE(joined.ok()) << joined.status();
    (r == 0 ? ga : gb) = std::move(*joined);
  });
  auto buffer = a.Allocate(sizeof(float));
  ASSERT_TRUE(buffer.ok());
  const absl::Time start = absl::Now();
  EXPECT_EQ(ga->AllReduceSum(buffer->f32(), 1, absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Broken for every rank from then on.
  EXPECT_EQ(ga->AllReduceSum(buffer->f32(), 1, absl::Seconds(1)).code(),
            absl::StatusCode::kFailedPrecondition);
  auto other = b.Allocate(sizeof(float));
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(gb->AllReduceSum(other->f32(), 1, absl::Seconds(1)).code(),
            absl::StatusCode::kDeadlineExceeded);

  // An abort asked for from another thread ends a waiting sum at once.
  auto id2 = a.NewGroupId();
  ASSERT_TRUE(id2.ok());
  OnEveryRank(2, [&](int r) {
    auto joined = (r == 0 ? a : b).JoinGroup(*id2, r, 2, absl::Seconds(10));
    ASSERT_TRUE(joined.ok()) << joined.status();
    (r == 0 ? ga : gb) = std::move(*joined);
  });
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ga->RequestAbort();
  });
  EXPECT_EQ(ga->AllReduceSum(buffer->f32(), 1, absl::Seconds(30)).code(),
            absl::StatusCode::kAborted);
  aborter.join();
}

}  // namespace
}  // namespace pith::runtime
