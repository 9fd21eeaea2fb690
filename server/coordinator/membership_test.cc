// Membership identities: a store's data dir, not its start order, decides its id, across
// coordinator restarts; claims that contradict the durable map are refused.
#include "server/coordinator/membership.h"

#include <atomic>
#include <map>
#include <string>

#include "common/ucx_address.h"
#include "gtest/gtest.h"

namespace pith::coordinator {
namespace {

v1::MemberInfo Store(const std::string& identity, const std::string& id = "") {
  v1::MemberInfo m;
  m.set_role(v1::MEMBER_ROLE_STORE);
  m.set_grpc_address("127.0.0.1:1");
  m.set_identity(identity);
  m.set_member_id(id);
  return m;
}

constexpr char kA[] = "0123456789abcdef0123456789abcdef";
constexpr char kB[] = "fedcba9876543210fedcba9876543210";
constexpr char kC[] = "00000000000000000000000000000001";

TEST(MembershipTest, IdentitiesKeepTheirIdsAcrossARestartInAnyOrder) {
  std::map<std::string, std::string> durable;  // what the coordinator's RocksDB holds
  auto persist = [&](const std::string& id, const std::string& identity) {
    durable[id] = identity;
    return absl::OkStatus();
  };
  {
    Membership members(absl::Seconds(3));
    members.RestoreIdentities({}, persist);
    EXPECT_EQ(*members.Register(Store(kA)), "store-0");
    EXPECT_EQ(*members.Register(Store(kB)), "store-1");
    EXPECT_EQ(*members.Register(Store(kA)), "store-0");  // a restart of the store alone
  }
  EXPECT_EQ(durable.size(), 2u);
  Membership restarted(absl::Seconds(3));
  restarted.RestoreIdentities(durable, persist);
  EXPECT_EQ(*restarted.Register(Store(kB)), "store-1");  // the other order
  EXPECT_EQ(*restarted.Register(Store(kC)), "store-2");  // a new store: a free id
  EXPECT_EQ(*restarted.Register(Store(kA)), "store-0");
  v1::MemberInfo worker;
  worker.set_role(v1::MEMBER_ROLE_WORKER);
  worker.set_grpc_address("127.0.0.1:2");
  EXPECT_EQ(*restarted.Register(worker), "worker-0");  // workers have none: as before
}

TEST(MembershipTest, ClaimsAgainstTheDurableMapAreRefused) {
  Membership members(absl::Seconds(3));
  members.RestoreIdentities({{"store-0", kA}, {"store-1", kB}}, nullptr);
  // A data dir claiming another store's id (its process kept an id it was given before).
  absl::StatusOr<std::string> wrong = members.Register(Store(kA, "store-1"));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("store-0"), absl::string_view::npos) << wrong.status();
  // A new data dir claiming an id another data dir holds.
  EXPECT_EQ(members.Register(Store(kC, "store-0")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A member without an identity cannot take an identity's id either.
  EXPECT_EQ(members.Register(Store("", "store-1")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*members.Register(Store(kB, "store-1")), "store-1");
}

// A store restarted within its lease lost that process's uncommitted writes: its new
// process waits until the old one is seen dead, so the scheduler reacts to the death.
TEST(MembershipTest, ARestartedStoreWaitsForItsOldLeaseToRunOut) {
  absl::Time now = absl::FromUnixSeconds(1000);
  Membership members(absl::Seconds(3), [&] { return now; });
  v1::MemberInfo first = Store(kA), second = Store(kA);
  first.set_ucx_address(WrapUcxAddress("first process address"));
  second.set_ucx_address(WrapUcxAddress("second process address"));
  ASSERT_EQ(*members.Register(first), "store-0");
  EXPECT_EQ(*members.Register(first), "store-0");  // the same process again: fine
  EXPECT_EQ(members.Register(second).status().code(), absl::StatusCode::kUnavailable);
  now += absl::Seconds(4);
  EXPECT_EQ(members.Register(second).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(members.ExpireLeases(), std::vector<std::string>{"store-0"});
  EXPECT_EQ(*members.Register(second), "store-0");
}

// A coordinator that did not run for 10 s (SIGSTOP, a paused VM) finds every lease lapsed
// on the wall clock; the time it did not run is not held against its members. A member
// silent for a lease while the coordinator runs still dies.
TEST(MembershipTest, APauseOfTheProcessDoesNotCostTheMembersTheirLeases) {
  absl::Time now = absl::FromUnixSeconds(1000);
  std::atomic<int64_t> ran_ms{0};  // the monotonic clock; the watch's thread reads it
  Membership members(absl::Seconds(3), [&] { return now; });
  members.WatchPauses([&] { return absl::Milliseconds(ran_ms.load()); });
  ASSERT_EQ(*members.Register(Store(kA)), "store-0");
  now += absl::Seconds(10);
  ran_ms += 10000;
  EXPECT_TRUE(members.ExpireLeases().empty());
  std::vector<std::string> dead;
  for (int i = 0; i < 8; ++i) {  // 4 s of running, looked at every 0.5 s
    now += absl::Milliseconds(500);
    ran_ms += 500;
    for (const std::string& id : members.ExpireLeases()) dead.push_back(id);
  }
  EXPECT_EQ(dead, std::vector<std::string>{"store-0"});
}

TEST(MembershipTest, AJunkUcxAddressIsRefusedAtRegistration) {
  Membership members(absl::Seconds(3));
  v1::MemberInfo m = Store(kA);
  m.set_ucx_address("x");  // would reach every peer that connects to this member
  absl::StatusOr<std::string> id = members.Register(m);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("member.ucx_address"), absl::string_view::npos);
  EXPECT_TRUE(members.Members(v1::MEMBER_ROLE_STORE).empty());
}

TEST(MembershipTest, AnIdentityThatCannotBeRecordedIsNotRegistered) {
  Membership members(absl::Seconds(3));
  members.RestoreIdentities({}, [](const std::string&, const std::string&) {
    return absl::UnavailableError("disk full");
  });
  EXPECT_EQ(members.Register(Store(kA)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(members.Members(v1::MEMBER_ROLE_STORE).empty());
}

// A store whose durable tier stopped says so in its heartbeats: it counts as dead (its
// jobs replace its copies) while its lease still runs.
TEST(MembershipTest, ACertificateRegistersAtMostItsQuotaOfIdentities) {
  Membership members(absl::Seconds(3));
  const Membership::IdentityQuota quota{"alice", 2};
  ASSERT_TRUE(members.Register(Store(std::string("alice/") + kA), quota).ok());
  ASSERT_TRUE(members.Register(Store(std::string("alice/") + kB), quota).ok());
  absl::StatusOr<std::string> third = members.Register(Store(std::string("alice/") + kC), quota);
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_NE(third.status().message().find("alice registered 2 members"), std::string::npos);
  // A known identity comes back; another certificate has its own quota.
  EXPECT_EQ(*members.Register(Store(std::string("alice/") + kA), quota), "store-0");
  EXPECT_TRUE(members.Register(Store(std::string("bob/") + kC), {{"bob", 2}}).ok());
}

TEST(MembershipTest, AnUnhealthyStoreCountsAsDead) {
  Membership members(absl::Seconds(3));
  auto id = members.Register(Store(kA));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(Snapshot(members).stores.count(*id), 1u);
  v1::MemberInfo status;
  status.set_health("INTERNAL: sync /data/blobs/000001.log: Input/output error");
  ASSERT_TRUE(members.Heartbeat(*id, status).ok());
  const Alive alive = Snapshot(members);
  EXPECT_EQ(alive.stores.count(*id), 0u);
  EXPECT_EQ(alive.known.count(*id), 1u);  // known, not alive: gone at once
  ASSERT_TRUE(members.Heartbeat(*id, v1::MemberInfo()).ok());
  EXPECT_EQ(Snapshot(members).stores.count(*id), 1u);
}

// A store with less than twice its disk reserve free is low on disk: it still serves
// what it holds, but takes no new copies (just above the reserve, every put bigger than
// what is left is refused). It is low until it has three times its reserve free and five
// minutes have passed, so that copies do not go back and forth as it sheds them.
TEST(MembershipTest, AStoreLowOnDiskServesButTakesNoNewCopies) {
  absl::Time now = absl::FromUnixSeconds(1000);
  Membership members(absl::Seconds(3), [&] { return now; });
  auto id = members.Register(Store(kA));
  ASSERT_TRUE(id.ok()) << id.status();
  auto heartbeat = [&](uint64_t free, uint64_t reserve) {
    v1::MemberInfo status;
    status.set_disk_reserve_bytes(reserve);
    status.set_disk_free_bytes(free);
    return members.Heartbeat(*id, status).ok();
  };
  const uint64_t reserve = 64 << 20;
  ASSERT_TRUE(heartbeat(2 * reserve, reserve));  // twice the reserve: room still
  EXPECT_TRUE(Snapshot(members).placeable(*id));
  ASSERT_TRUE(heartbeat(2 * reserve - 1, reserve));
  Alive alive = Snapshot(members);
  EXPECT_EQ(alive.stores.count(*id), 1u);
  EXPECT_FALSE(alive.placeable(*id));
  EXPECT_TRUE(alive.placeable_ids().empty());
  EXPECT_TRUE(members.Members(v1::MEMBER_ROLE_STORE).front().disk_low());
  ASSERT_TRUE(heartbeat(2 * reserve, reserve));  // not yet three times
  EXPECT_FALSE(Snapshot(members).placeable(*id));
  now += kLowDiskCooldown - absl::Seconds(2);
  ASSERT_TRUE(heartbeat(3 * reserve, reserve));  // not yet five minutes
  EXPECT_FALSE(Snapshot(members).placeable(*id));
  now += absl::Seconds(2);
  ASSERT_TRUE(heartbeat(3 * reserve, reserve));
  EXPECT_TRUE(Snapshot(members).placeable(*id));
  EXPECT_FALSE(members.Members(v1::MEMBER_ROLE_STORE).front().disk_low());
  ASSERT_TRUE(heartbeat(reserve - 1, reserve));  // under the reserve itself
  EXPECT_FALSE(Snapshot(members).placeable(*id));
  // A small disk that never frees three times its reserve: over twice it for five
  // minutes in a row will do (a dip under the line starts the five minutes again).
  now += kLowDiskCooldown;
  ASSERT_TRUE(heartbeat(5 * reserve / 2, reserve));
  now += kLowDiskCooldown - absl::Seconds(2);
  ASSERT_TRUE(heartbeat(2 * reserve - 1, reserve));
  ASSERT_TRUE(heartbeat(5 * reserve / 2, reserve));
  now += absl::Seconds(2);
  ASSERT_TRUE(heartbeat(5 * reserve / 2, reserve));
  EXPECT_FALSE(Snapshot(members).placeable(*id));
  now += kLowDiskCooldown - absl::Seconds(2);
  ASSERT_TRUE(heartbeat(5 * reserve / 2, reserve));
  EXPECT_TRUE(Snapshot(members).placeable(*id));
  ASSERT_TRUE(members.Heartbeat(*id, v1::MemberInfo()).ok());  // no disk figures: not low
  EXPECT_EQ(Snapshot(members).placeable_ids(), std::vector<std::string>{*id});
}

}  // namespace
}  // namespace pith::coordinator
