#include "security/tokens.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace pith::security {
namespace {

std::optional<Identity> Find(TokenTable& table, const std::string& token) {
  absl::StatusOr<Identity> id = table.Lookup(token);
  if (!id.ok()) return std::nullopt;
  return *id;
}

std::string TempFile(const std::string& name) {
  const std::string path = ::testing::TempDir() + "/tokens_test_" + name;
  std::filesystem::remove(path);
  return path;
}

TEST(TokensTest, ATokenIsItsOwnersAndOnlyItsHashIsKept) {
  const std::string path = TempFile("own");
  auto alice = AddToken(path, {Role::kUser, "alice"});
  auto ops = AddToken(path, {Role::kAdmin, "ops"});
  ASSERT_TRUE(alice.ok() && ops.ok());
  EXPECT_NE(*alice, *ops);
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text.find(*alice), std::string::npos) << "the token itself was written";
  EXPECT_NE(text.find(TokenHash(*alice)), std::string::npos);
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);

  auto table = TokenTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(Find(**table, *alice), (Identity{Role::kUser, "alice"}));
  EXPECT_EQ(Find(**table, *ops), (Identity{Role::kAdmin, "ops"}));
  EXPECT_EQ(Find(**table, *alice + "x"), std::nullopt);
  EXPECT_EQ(Find(**table, ""), std::nullopt);
}

TEST(TokensTest, TokensAddedOrRemovedLaterCountWithoutARestart) {
  const std::string path = TempFile("later");
  auto table = TokenTable::Open(path);  // no file yet: no token
  ASSERT_TRUE(table.ok()) << table.status();
  auto bob = AddToken(path, {Role::kUser, "bob"});
  ASSERT_TRUE(bob.ok());
  absl::SleepFor(absl::Milliseconds(1100));  // the file is looked at once a second
  EXPECT_EQ(Find(**table, *bob), (Identity{Role::kUser, "bob"}));
  std::filesystem::remove(path);
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Find(**table, *bob), std::nullopt);
}

// A file that appears after the coordinator started is read as a later version: its
// malformed lines are left out, the rest apply (it kept every token out before).
TEST(TokensTest, AFileThatAppearsLaterWithABadLineKeepsItsGoodTokens) {
  const std::string path = TempFile("appears");
  auto table = TokenTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status();
  auto bob = AddToken(path, {Role::kUser, "bob"});
  ASSERT_TRUE(bob.ok());
  std::ofstream(path, std::ios::app) << "garbage line\n";
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Find(**table, *bob), (Identity{Role::kUser, "bob"}));
}

// Whoever may write the tokens file could add an admin: a file others may write keeps
// the coordinator from starting, and a later one counts no token until it is fixed.
TEST(TokensTest, AFileOthersMayWriteCountsNoToken) {
  namespace fs = std::filesystem;
  const std::string path = TempFile("writable");
  auto ops = AddToken(path, {Role::kAdmin, "ops"});
  ASSERT_TRUE(ops.ok());
  fs::permissions(path, fs::perms::others_write, fs::perm_options::add);
  auto refused = TokenTable::Open(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("mode 0602"), std::string::npos) << refused.status();
  fs::permissions(path, fs::perms::others_write, fs::perm_options::remove);
  auto table = TokenTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(Find(**table, *ops), (Identity{Role::kAdmin, "ops"}));
  fs::permissions(path, fs::perms::group_write, fs::perm_options::add);  // a chmod alone
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Find(**table, *ops), std::nullopt);
  fs::permissions(path, fs::perms::group_write, fs::perm_options::remove);
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Find(**table, *ops), (Identity{Role::kAdmin, "ops"}));
}

// A token made to expire works until then, and is refused after with its owner and time
// named; a file's expiry is read as written, and a malformed one is a malformed line.
TEST(TokensTest, AnExpiredTokenIsRefusedSayingWhen) {
  const std::string path = TempFile("expiry");
  const absl::Time soon = absl::FromUnixSeconds(absl::ToUnixSeconds(absl::Now()) + 2);
  auto carol = AddToken(path, {Role::kUser, "carol"}, nullptr, soon);
  ASSERT_TRUE(carol.ok()) << carol.status();
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find(" expires=" + absl::FormatTime(absl::RFC3339_sec, soon, absl::UTCTimeZone())),
            std::string::npos)
      << text;
  auto table = TokenTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(Find(**table, *carol), (Identity{Role::kUser, "carol"}));
  absl::SleepFor(soon - absl::Now());
  absl::StatusOr<Identity> late = (*table)->Lookup(*carol);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(late.status().message().find(
                "the bearer token of carol expired at " +
                absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", soon, absl::UTCTimeZone())),
            std::string::npos)
      << late.status();
  std::ofstream(path) << "dave user " << std::string(64, 'a') << " expires=2030-01-02T03:04:05Z\n";
  EXPECT_TRUE(TokenTable::Open(path).ok());
  std::ofstream(path) << "dave user " << std::string(64, 'a') << " expires=soon\n";
  EXPECT_EQ(TokenTable::Open(path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokensTest, MembersGetNoTokensAndABrokenFileIsNamed) {
  const std::string path = TempFile("bad");
  EXPECT_EQ(AddToken(path, {Role::kMember, "store0"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddToken(path, {Role::kCoordinator, "c"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::ofstream(path) << "# a comment\nalice user " << std::string(64, 'a') << "\n"
                      << "mallory member " << std::string(64, 'b') << "\n";
  auto table = TokenTable::Open(path);
  EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(table.status().message().find("line 3"), std::string::npos) << table.status();
  // pith token never writes into a file that is not a token file (a mistyped --file).
  const std::string spec = TempFile("spec.json");
  std::ofstream(spec) << "{\"name\": \"demo\"}\n";
  auto added = AddToken(spec, {Role::kUser, "bob"});
  EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(added.status().message().find("not a token file"), std::string::npos) << added.status();
  std::ifstream in(spec);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "{\"name\": \"demo\"}\n");
  // A token file with a bad line still takes a revocation (and a new token).
  const std::string tokens = TempFile("typo");
  auto carol = AddToken(tokens, {Role::kUser, "carol"});
  ASSERT_TRUE(carol.ok()) << carol.status();
  ASSERT_TRUE(AddToken(tokens, {Role::kAdmin, "frank"}).ok());
  std::ofstream(tokens, std::ios::app) << "dave usr oops\n";
  auto revoked = RevokeTokens(tokens, "carol");
  ASSERT_TRUE(revoked.ok()) << revoked.status();
  EXPECT_EQ(*revoked, 1);
  EXPECT_TRUE(AddToken(tokens, {Role::kUser, "erin"}).ok());
}

TEST(TokensTest, ARemovalBesideABadEditStillRevokes) {
  const std::string path = TempFile("revoke");
  auto alice = AddToken(path, {Role::kUser, "alice"});
  auto bob = AddToken(path, {Role::kUser, "bob"});
  ASSERT_TRUE(alice.ok() && bob.ok());
  auto table = TokenTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_TRUE(Find(**table, *alice).has_value());
  // alice's line removed, and a typo left behind: bob still counts, alice no longer.
  std::ofstream(path) << "bob user " << TokenHash(*bob) << "\nalice usr oops\n";
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Find(**table, *alice), std::nullopt);
  EXPECT_EQ(Find(**table, *bob), (Identity{Role::kUser, "bob"}));
}

// A second token for a name replaces the first (a leaked token is rotated by issuing a new
// one); a revocation removes the name's tokens; other lines and comments stay.
TEST(TokensTest, ANewTokenReplacesTheNamesEarlierOneAndARevocationRemovesIt) {
  const std::string path = TempFile("rotate");
  std::ofstream(path) << "# the team's tokens\n\n";
  // The mode the operator gave it stays (the coordinator's group may read it).
  const auto mode = std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                    std::filesystem::perms::group_read;
  std::filesystem::permissions(path, mode);
  int replaced = -1;
  auto bob1 = AddToken(path, {Role::kUser, "bob"}, &replaced);
  EXPECT_EQ(replaced, 0);
  auto alice = AddToken(path, {Role::kAdmin, "alice"});
  auto bob2 = AddToken(path, {Role::kUser, "bob"}, &replaced);
  ASSERT_TRUE(bob1.ok() && alice.ok() && bob2.ok());
  EXPECT_EQ(replaced, 1);
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all, mode);
  auto table = TokenTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(Find(**table, *bob1), std::nullopt);
  EXPECT_EQ(Find(**table, *bob2), (Identity{Role::kUser, "bob"}));
  EXPECT_EQ(Find(**table, *alice), (Identity{Role::kAdmin, "alice"}));

  auto revoked = RevokeTokens(path, "bob");
  ASSERT_TRUE(revoked.ok()) << revoked.status();
  EXPECT_EQ(*revoked, 1);
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Find(**table, *bob2), std::nullopt);
  EXPECT_EQ(Find(**table, *alice), (Identity{Role::kAdmin, "alice"}));
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text.rfind("# the team's tokens\n\nalice admin ", 0), 0u) << text;
  EXPECT_EQ(RevokeTokens(path, "bob").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(RevokeTokens(path + ".missing", "bob").status().code(), absl::StatusCode::kNotFound);
  // A symlink is not replaced by a file of its own (the coordinator reads its target).
  const std::string link = path + ".link";
  std::filesystem::remove(link);
  std::filesystem::create_symlink(path, link);
  EXPECT_EQ(AddToken(link, {Role::kUser, "carol"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::filesystem::is_symlink(link));
}

}  // namespace
}  // namespace pith::security
