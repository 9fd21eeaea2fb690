#include "security/certs.h"

#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "security/openssl_util.h"
#include "security/tls.h"

namespace pith::security {
namespace {

// The certificate's DNS and IP names, and whether it may serve (serverAuth).
std::pair<int, bool> HostsAndServing(const std::string& path) {
  absl::StatusOr<internal::Cert> cert = internal::LoadCert(path);
  EXPECT_TRUE(cert.ok()) << cert.status();
  if (!cert.ok()) return {-1, false};
  int hosts = 0;
  auto* names = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(cert->get(), NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names); ++i) {
    const int type = sk_GENERAL_NAME_value(names, i)->type;
    hosts += type == GEN_DNS || type == GEN_IPADD;
  }
  GENERAL_NAMES_free(names);
  return {hosts, (X509_get_extended_key_usage(cert->get()) & XKU_SSL_SERVER) != 0};
}

class CertsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/certs_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(CertsTest, IssuedDirectoriesCheckOutWithTheirIdentity) {
  ASSERT_EQ(EnsureCa(dir_).value(), true);
  EXPECT_EQ(EnsureCa(dir_).value(), false);  // kept, not replaced
  ASSERT_TRUE(Issue(dir_, {Role::kMember, "store-0"}).ok());
  ASSERT_TRUE(Issue(dir_, {Role::kMember, "store-1"}, {.hosts = {"10.0.0.7", "node7"}}).ok());
  ASSERT_TRUE(Issue(dir_, {Role::kUser, "alice"}).ok());
  // A member serves at this machine's names and those given; a person's serves nothing.
  const auto [store_hosts, store_serves] = HostsAndServing(dir_ + "/store-1/cert.pem");
  EXPECT_EQ(store_hosts, static_cast<int>(DefaultHosts().size()) + 2);
  EXPECT_TRUE(store_serves);
  EXPECT_EQ(HostsAndServing(dir_ + "/alice/cert.pem"), std::make_pair(0, false));
  EXPECT_EQ(Issue(dir_, {Role::kAdmin, "ops"}, {.hosts = {"node7"}}).code(),
            absl::StatusCode::kInvalidArgument);
  auto store = CheckTlsDir(dir_ + "/store-0");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(*store, (Identity{Role::kMember, "store-0"}));
  auto alice = CheckTlsDir(dir_ + "/alice");
  ASSERT_TRUE(alice.ok()) << alice.status();
  EXPECT_EQ(*alice, (Identity{Role::kUser, "alice"}));

  struct stat st;
  ASSERT_EQ(::stat((dir_ + "/store-0/key.pem").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat((dir_ + "/ca.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(CertsTest, AKeyInUseIsNeverReplaced) {
  ASSERT_TRUE(EnsureCa(dir_).ok());
  ASSERT_TRUE(Issue(dir_, {Role::kMember, "worker-0"}).ok());
  std::ifstream before(dir_ + "/worker-0/key.pem");
  const std::string key((std::istreambuf_iterator<char>(before)), {});
  EXPECT_EQ(Issue(dir_, {Role::kAdmin, "worker-0"}).code(), absl::StatusCode::kAlreadyExists);
  std::ifstream after(dir_ + "/worker-0/key.pem");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(after)), {}), key);
  // A directory an issue left half-written (a key, no certificate) is named, not reused.
  std::filesystem::remove(dir_ + "/worker-0/cert.pem");
  absl::Status half = Issue(dir_, {Role::kMember, "worker-0"});
  EXPECT_EQ(half.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(half.message().find("remove " + dir_ + "/worker-0"), std::string::npos) << half;
}

TEST_F(CertsTest, BadNamesHostsAndAMissingCaAreRefused) {
  EXPECT_EQ(Issue(dir_, {Role::kUser, "bob"}).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(EnsureCa(dir_).ok());
  for (const char* name : {"", "../x", "a/b", ".hidden", "sp ace"}) {
    EXPECT_EQ(Issue(dir_, {Role::kUser, name}).code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_EQ(Issue(dir_, {Role::kMember, "carol"}, {.hosts = {"a,b"}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Issue(dir_, {Role::kMember, "carol"}, {.hosts = {"x,URI:pith://admin/x"}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/carol"));
}

TEST_F(CertsTest, AMismatchedKeyOrAForeignCaFailsTheCheckWithTheReason) {
  ASSERT_TRUE(EnsureCa(dir_ + "/a").ok());
  ASSERT_TRUE(EnsureCa(dir_ + "/b").ok());
  ASSERT_TRUE(Issue(dir_ + "/a", {Role::kMember, "store-0"}).ok());
  ASSERT_TRUE(Issue(dir_ + "/b", {Role::kMember, "store-0"}).ok());
  // b's CA beside a's certificate: the chain does not verify.
  std::filesystem::copy_file(dir_ + "/b/ca.pem", dir_ + "/a/store-0/ca.pem",
                             std::filesystem::copy_options::overwrite_existing);
  auto foreign = CheckTlsDir(dir_ + "/a/store-0");
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(foreign.status().message().find("does not verify"), std::string::npos)
      << foreign.status();
  // b's key beside b's CA but a's certificate... the key does not match.
  std::filesystem::copy_file(dir_ + "/b/store-0/key.pem", dir_ + "/a/store-0/key.pem",
                             std::filesystem::copy_options::overwrite_existing);
  auto key = CheckTlsDir(dir_ + "/a/store-0");
  EXPECT_NE(key.status().message().find("is not the key of"), std::string::npos) << key.status();
  auto missing = CheckTlsDir(dir_ + "/nothing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("ca.pem"), std::string::npos);
}

TEST(IdentityTest, UrisRoundTripAndJunkIsRefused) {
  for (Role r : {Role::kMember, Role::kCoordinator, Role::kAdmin, Role::kUser}) {
    Identity id{r, "x-1.y_z"};
    EXPECT_EQ(ParseIdentityUri(IdentityUri(id)).value(), id);
  }
  for (const char* junk :
       {"pith://root/x", "pith://user", "pith://user/", "http://user/x", "pith://user/a/b"}) {
    EXPECT_FALSE(ParseIdentityUri(junk).ok()) << junk;
  }
}

}  // namespace
}  // namespace pith::security
