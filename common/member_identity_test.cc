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

}  // namespace
}  // namespace pith
