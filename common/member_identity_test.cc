#include "common/member_identity.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace pith {
namespace {

TEST(MemberIdentityTest, MadeOnceThenReadBackAndCheckedForDamage) {
  const std::string dir = ::testing::TempDir() + "/identity_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  absl::StatusOr<std::string> first = LoadOrCreateIdentity(dir);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->size(), 32u);
  EXPECT_EQ(*LoadOrCreateIdentity(dir), *first);
  const std::string other = ::testing::TempDir() + "/identity_other_" + std::to_string(getpid());
  std::filesystem::create_directories(other);
  EXPECT_NE(*LoadOrCreateIdentity(other), *first);  // random per data dir
  std::ofstream(dir + "/pith-member-identity") << "not an identity\n";
  absl::StatusOr<std::string> damaged = LoadOrCreateIdentity(dir);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(damaged.status().message().find("pith-member-identity"), absl::string_view::npos);
  EXPECT_FALSE(LoadOrCreateIdentity(dir + "/missing/dir").ok());
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(other);
}

// The first cluster a data dir joins is kept; another is refused by name; a coordinator
// that sends no id (older than the check) changes nothing.
TEST(MemberIdentityTest, ADataDirKeepsItsClusterAndJoinsNoOther) {
  const std::string dir = ::testing::TempDir() + "/cluster_id_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  EXPECT_TRUE(KeepClusterId(dir, "").ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/pith-cluster-id"));
  ASSERT_TRUE(KeepClusterId(dir, "aaaa").ok());
  EXPECT_TRUE(KeepClusterId(dir, "aaaa").ok());
  EXPECT_TRUE(KeepClusterId(dir, "").ok());
  const absl::Status other = KeepClusterId(dir, "bbbb");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find(dir + " belongs to cluster aaaa, and this coordinator's is bbbb"),
            absl::string_view::npos)
      << other;
  EXPECT_TRUE(KeepClusterId(dir, "aaaa").ok());  // the refusal changed nothing
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pith
