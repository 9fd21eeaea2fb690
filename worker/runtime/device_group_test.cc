// JoinDeviceGroup over a real PeerGroup (UCX loopback) with OpaqueBackend's device group:
// every rank joins, the sums are the rank-order sums and an exchange delivers each pair's
// transfers in order; when one rank cannot join, no rank uses a group; a CPU backend has
// none. The group's deadline and abort end a sum a peer never joins.
#include "worker/runtime/device_group.h"

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/compute/opaque_backend.h"
#include "worker/runtime/peer_channels.h"
#include "worker/runtime/peer_group_testing.h"

namespace pith::runtime {
namespace {

// An OpaqueBackend whose joins fail (a second worker on the same GPU, as NCCL sees it).
class NoJoinBackend : public compute::OpaqueBackend {
 public:
  absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> JoinGroup(
      const std::string&, int, int, absl::Duration, const std::atomic<bool>&) override {
    return absl::InvalidArgumentError("duplicate GPU");
  }
};

const std::atomic<bool> kNever{false};

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
    auto group = JoinDeviceGroup(backend, *peers[r], absl::Seconds(10), kNever);
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

// An exchange delivers each pair's transfers in their order, skips empty ones (a pair
// with nothing to say posts nothing), and fails for every rank when sizes disagree.
TEST(DeviceGroupTest, AnExchangeDeliversEachPairsTransfersInOrder) {
  constexpr int kRanks = 3;
  auto peers = JoinedPeerGroups(kRanks);
  // Rank r sends rank q (q != r) two transfers, of r + q and 1 floats, valued 100r + 10q
  // + which; nothing to itself but one empty transfer.
  auto value = [](int from, int to, int which) { return 100.0f * from + 10.0f * to + which; };
  OnEveryRank(kRanks, [&](int r) {
    compute::OpaqueBackend backend(1);
    auto group = JoinDeviceGroup(backend, *peers[r], absl::Seconds(10), kNever);
    ASSERT_TRUE(group.ok() && *group != nullptr) << group.status();
    std::vector<compute::DeviceBuffer> keep;
    std::vector<compute::DeviceTransfer> sends, recvs;
    std::vector<std::pair<float*, std::vector<float>>> expect;
    for (int q = 0; q < kRanks; ++q) {
      for (int which = 0; which < 2; ++which) {
        const size_t n = q == r ? 0 : which == 0 ? r + q : 1;
        auto out = backend.Allocate(std::max<size_t>(n, 1) * sizeof(float));
        auto in = backend.Allocate(std::max<size_t>(n, 1) * sizeof(float));
        ASSERT_TRUE(out.ok() && in.ok());
        const std::vector<float> mine(n, value(r, q, which));
        ASSERT_TRUE(backend.CopyToDevice(out->data(), mine.data(), n * sizeof(float)).ok());
        sends.push_back({q, out->data(), n * sizeof(float)});
        recvs.push_back({q, in->data(), n * sizeof(float)});
        expect.emplace_back(in->f32(), std::vector<float>(n, value(q, r, which)));
        keep.push_back(std::move(*out));
        keep.push_back(std::move(*in));
      }
    }
    ASSERT_TRUE((*group)->Exchange(sends, recvs, absl::Seconds(10)).ok());
    for (const auto& [at, want] : expect) {
      std::vector<float> got(want.size());
      ASSERT_TRUE(backend.CopyToHost(got.data(), at, got.size() * sizeof(float)).ok());
      EXPECT_EQ(got, want) << "rank " << r;
    }
    // Every rank done with that exchange before the next breaks the group.
    double barrier = 1;
    ASSERT_TRUE(peers[r]->AllReduceSum(&barrier, 1, /*tag=*/77).ok());
    // A receive of another size than what was sent breaks the group (rank 0 expects 2
    // floats from rank 1, which sends 1); rank 2 waits for rank 0 and sees the break.
    auto buf = backend.Allocate(2 * sizeof(float));
    ASSERT_TRUE(buf.ok());
    std::vector<compute::DeviceTransfer> s, g;
    if (r == 1) s.push_back({0, buf->data(), sizeof(float)});
    if (r == 0) g.push_back({1, buf->data(), 2 * sizeof(float)});
    if (r == 2) g.push_back({0, buf->data(), sizeof(float)});
    const absl::Status st = (*group)->Exchange(s, g, absl::Seconds(10));
    if (r == 0) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    } else if (r == 2) {
      EXPECT_FALSE(st.ok());
    }
    EXPECT_EQ((*group)->Exchange({}, {}, absl::Seconds(1)).code(),
              r == 1 ? absl::StatusCode::kOk : absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*group)->Exchange({{kRanks, buf->data(), 4}}, {}, absl::Seconds(1)).code(),
              r == 1 ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kFailedPrecondition);
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
    auto group = JoinDeviceGroup(*backend, *peers[r], absl::Milliseconds(300), kNever);
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ(*group, nullptr) << "rank " << r;
  });
  // A backend reading host memory has none, whatever the world.
  compute::CpuBackend cpu(1);
  auto group = JoinDeviceGroup(cpu, *peers[0], absl::Seconds(1), kNever);
  ASSERT_TRUE(group.ok());
  EXPECT_EQ(*group, nullptr);
}

TEST(DeviceGroupTest, ASumAPeerNeverJoinsEndsAtItsDeadlineOrAnAbort) {
  compute::OpaqueBackend a(1), b(1);
  auto id = a.NewGroupId();
  ASSERT_TRUE(id.ok());
  std::unique_ptr<compute::DeviceGroup> ga, gb;
  OnEveryRank(2, [&](int r) {
    auto joined = (r == 0 ? a : b).JoinGroup(*id, r, 2, absl::Seconds(10), kNever);
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
    auto joined = (r == 0 ? a : b).JoinGroup(*id2, r, 2, absl::Seconds(10), kNever);
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

// A rank whose attempt is aborted while it waits in the join for a peer that never comes
// ends the join at once, not at its timeout, and the run goes on without a group.
TEST(DeviceGroupTest, AnAbortEndsAJoinInProgress) {
  auto peers = JoinedPeerGroups(2);
  DeviceGroupSlot slot;
  OnEveryRank(2, [&](int r) {
    if (r == 1) {
      // Rank 1 takes the id and never joins: it says at once that it has no group.
      auto id = peers[1]->Broadcast(0, channels::DeviceGroupId(), "");
      ASSERT_TRUE(id.ok()) << id.status();
      double joined = 0;
      ASSERT_TRUE(peers[1]->AllReduceSum(&joined, 1, channels::DeviceGroupJoined()).ok());
      return;
    }
    compute::OpaqueBackend backend(1);
    std::thread aborter([&] {
      absl::SleepFor(absl::Milliseconds(300));
      slot.Abort();
    });
    const absl::Time start = absl::Now();
    EXPECT_TRUE(slot.Rejoin(backend, *peers[0], absl::Seconds(30)).ok());
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the join waited for its timeout";
    EXPECT_EQ(slot.group(), nullptr);
    aborter.join();
  });
}

}  // namespace
}  // namespace pith::runtime
