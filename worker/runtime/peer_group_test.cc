// Three PeerGroups in one process over UCX loopback: tagged messages, the deterministic
// all-reduce, attempts dropping stale messages, and timeouts.
#include "worker/runtime/peer_group.h"

#include <filesystem>
#include <thread>
#include <vector>

#include "common/status.h"
#include "gtest/gtest.h"
#include "worker/runtime/peer_group_testing.h"

namespace pith::runtime {
namespace {

std::vector<std::unique_ptr<PeerGroup>> Group(int n, uint64_t attempt = 1) {
  return JoinedPeerGroups(n, attempt);
}

TEST(PeerGroupTest, TaggedMessagesArriveWhereverTheyAreAwaited) {
  auto g = Group(2);
  ASSERT_TRUE(g[0]->Send(1, 7, "seven").ok());
  ASSERT_TRUE(g[0]->Send(1, 5, std::string(1 << 20, 'x')).ok());  // rendezvous-sized
  auto five = g[1]->Receive(0, 5);
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(five->size(), 1u << 20);
  auto seven = g[1]->Receive(0, 7);
  ASSERT_TRUE(seven.ok());
  EXPECT_EQ(*seven, "seven");
  EXPECT_EQ(g[1]->Receive(0, 9, absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(g[0]->Send(0, 1, "self").code(), absl::StatusCode::kInvalidArgument);
}

TEST(PeerGroupTest, AllReduceGivesEveryRankTheSameBits) {
  auto g = Group(3);
  std::vector<std::vector<float>> v(3);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 1000; ++i) v[r].push_back(0.1f * (i + 1) / (r + 3));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(3);
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { status[r] = g[r]->AllReduceSum(v[r].data(), v[r].size(), 42); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(status[r].ok()) << status[r];
  for (int i = 0; i < 1000; ++i) {
    const float want = 0.1f * (i + 1) / 3 + 0.1f * (i + 1) / 4 + 0.1f * (i + 1) / 5;
    EXPECT_EQ(v[0][i], v[1][i]);
    EXPECT_EQ(v[1][i], v[2][i]);
    EXPECT_NEAR(v[0][i], want, 1e-4 * want);
  }
}

// How GPU workers share an NCCL id: the root's bytes (here rank 1's) reach every rank;
// a root outside the group is refused, and a root that never sends is a deadline, not a
// hang.
TEST(PeerGroupTest, BroadcastGivesEveryRankTheRootsBytes) {
  auto g = Group(3);
  const std::string id(128, '\x5a');
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<std::string>> got(3, std::string());
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { got[r] = g[r]->Broadcast(1, 77, r == 1 ? id : "not mine"); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(got[r].ok()) << got[r].status();
    EXPECT_EQ(*got[r], id) << "rank " << r;
  }
  EXPECT_EQ(g[0]->Broadcast(3, 78, "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g[0]->Broadcast(2, 79, "", absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(PeerGroupTest, ANewAttemptDropsOlderMessagesAndKeepsNewerOnes) {
  auto g = Group(2, /*attempt=*/1);
  ASSERT_TRUE(g[0]->Send(1, 3, "old").ok());
  ASSERT_TRUE(g[1]->Receive(0, 3).ok());
  ASSERT_TRUE(g[0]->Send(1, 4, "stale").ok());
  absl::SleepFor(absl::Milliseconds(100));
  g[1]->SetAttempt(2);
  EXPECT_EQ(g[1]->Receive(0, 4, absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // A peer that starts attempt 3 first: its message waits for this side to get there.
  g[0]->SetAttempt(3);
  ASSERT_TRUE(g[0]->Send(1, 4, "early").ok());
  absl::SleepFor(absl::Milliseconds(100));
  g[1]->SetAttempt(3);
  auto got = g[1]->Receive(0, 4);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "early");
}

TEST(PeerGroupTest, AbandoningAnAttemptReleasesItsWaiters) {
  auto g = Group(2);
  std::thread abort([&] {
    absl::SleepFor(absl::Milliseconds(100));
    g[1]->Abandon();
  });
  const absl::Time start = absl::Now();
  EXPECT_EQ(g[1]->Receive(0, 1, absl::Seconds(30)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  abort.join();
  const absl::Status sent = g[1]->Send(0, 2, "x");
  EXPECT_EQ(sent.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(UnreachablePeer(sent), -1);  // an abort is no peer's doing
}

// A failure a peer caused names its rank (the failure report names the worker), through
// the annotations on its way up; the first rank marked stays.
TEST(PeerGroupTest, ASilentPeerIsNamedInTheFailure) {
  auto g = Group(3);
  const auto r = g[0]->Receive(2, 1, absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(UnreachablePeer(r.status()), 2);
  EXPECT_EQ(UnreachablePeer(WithUnreachablePeer(Annotate(r.status(), "layer 0"), 1)), 2);
  EXPECT_EQ(UnreachablePeer(absl::UnavailableError("x")), -1);
}

// An attempt abandoned before this side started it (the abort watch saw the abort, or
// the process's stop, before the run's setup joined) starts abandoned: its waits end at
// once instead of at their timeouts. A later attempt runs.
TEST(PeerGroupTest, AnAttemptAbandonedBeforeItStartedStartsAbandoned) {
  auto g = Group(2, /*attempt=*/3);
  EXPECT_FALSE(g[1]->AbandonAttempt(7));
  g[1]->SetAttempt(7);
  const absl::Time start = absl::Now();
  EXPECT_EQ(g[1]->Receive(0, 1, absl::Seconds(30)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(g[1]->Send(0, 2, "x").code(), absl::StatusCode::kUnavailable);
  // The mark is used up: a newer attempt runs.
  g[0]->SetAttempt(8);
  g[1]->SetAttempt(8);
  ASSERT_TRUE(g[0]->Send(1, 5, "eight").ok());
  auto got = g[1]->Receive(0, 5);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "eight");
  // The current attempt abandoned, then started again by a join (a retried setup).
  EXPECT_TRUE(g[1]->AbandonAttempt(8));
  g[1]->SetAttempt(8);
  EXPECT_EQ(g[1]->Send(0, 6, "x").code(), absl::StatusCode::kUnavailable);
}

int OpenFiles() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Workers join a group per job, with the same peers again and again: the connections
// between them must not pile up (each join once left a socket behind on both sides, and
// a worker ran out of descriptors after some thousands of jobs).
TEST(PeerGroupTest, JoiningAgainAndAgainKeepsTheConnectionsItHas) {
  auto g = Group(2);
  const std::vector<std::string> addresses = {g[0]->address(), g[1]->address()};
  auto exchange = [&](uint64_t attempt) {
    ASSERT_TRUE(g[0]->Send(1, 1, "ping").ok());
    ASSERT_TRUE(g[1]->Send(0, 1, "pong").ok());
    auto a = g[1]->Receive(0, 1);
    auto b = g[0]->Receive(1, 1);
    ASSERT_TRUE(a.ok()) << a.status() << " attempt " << attempt;
    ASSERT_TRUE(b.ok()) << b.status() << " attempt " << attempt;
    EXPECT_EQ(*a, "ping");
    EXPECT_EQ(*b, "pong");
  };
  exchange(1);
  const int before = OpenFiles();
  for (uint64_t attempt = 2; attempt < 40; ++attempt) {
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(g[r]->Join(r, addresses, attempt).ok());
    exchange(attempt);
  }
  EXPECT_LE(OpenFiles(), before + 2);
  // Ranks may swap between jobs: the same connections serve.
  const std::vector<std::string> swapped = {addresses[1], addresses[0]};
  ASSERT_TRUE(g[1]->Join(0, swapped, 50).ok());
  ASSERT_TRUE(g[0]->Join(1, swapped, 50).ok());
  ASSERT_TRUE(g[1]->Send(1, 2, "from rank 0").ok());
  ASSERT_TRUE(g[0]->Send(0, 2, "from rank 1").ok());
  auto at1 = g[0]->Receive(0, 2);
  auto at0 = g[1]->Receive(1, 2);
  ASSERT_TRUE(at1.ok()) << at1.status();
  ASSERT_TRUE(at0.ok()) << at0.status();
  EXPECT_EQ(*at1, "from rank 0");
  EXPECT_EQ(*at0, "from rank 1");
  EXPECT_LE(OpenFiles(), before + 2);
}

// A peer that goes away fails the ranks it holds in the current group, and a later group
// with a new peer in its place connects to it.
TEST(PeerGroupTest, APeerThatGoesAwayFailsItsRankAndTheNextGroupConnectsAfresh) {
  auto g = Group(2);
  g[1].reset();  // its process ended: its connections close
  const absl::Time start = absl::Now();
  const auto r = g[0]->Receive(1, 1, absl::Seconds(30));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_EQ(UnreachablePeer(r.status()), 1);
  EXPECT_EQ(UnreachablePeer(g[0]->Send(1, 2, "x")), 1);
  auto fresh = PeerGroup::Create();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  g[1] = std::move(*fresh);
  const std::vector<std::string> addresses = {g[0]->address(), g[1]->address()};
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(g[r]->Join(r, addresses, 2).ok());
  ASSERT_TRUE(g[0]->Send(1, 1, "again").ok());
  auto got = g[1]->Receive(0, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "again");
}

}  // namespace
}  // namespace pith::runtime
