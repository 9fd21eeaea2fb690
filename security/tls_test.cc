// Mutual TLS and the authorization policy on a real gRPC server on loopback: who gets in,
// who is refused, and with what status.
#include "security/tls.h"

#include <filesystem>
#include <fstream>

#include "common/grpc_util.h"
#include "gtest/gtest.h"
#include "pith/v1/store.grpc.pb.h"
#include "security/authorize.h"
#include "security/certs.h"

namespace pith::security {
namespace {

// GetStats admits the coordinator and admins; ListBlobs is missing from the table. One
// bearer token is valid: "t0ken", ops's (admin).
class Service final : public v1::StoreService::Service {
 public:
  explicit Service(bool enforce)
      : policy_(enforce, {{"GetStats", {Role::kCoordinator, Role::kAdmin}}},
                [](const std::string& token) -> absl::StatusOr<Identity> {
                  if (token == "t0ken") return Identity{Role::kAdmin, "ops"};
                  return absl::UnauthenticatedError(
                      "the bearer token is not valid (one just made with pith token is taken "
                      "within a few seconds)");
                }) {}
  grpc::Status GetStats(grpc::ServerContext* ctx, const v1::GetStatsRequest*,
                        v1::StoreStats* reply) override {
    auto caller = policy_.Check(*ctx, "GetStats");
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    reply->set_blobs(caller->has_value() ? (*caller)->name.size() : 0);
    return grpc::Status::OK;
  }
  grpc::Status ListBlobs(grpc::ServerContext* ctx, const v1::ListBlobsRequest*,
                         v1::ListBlobsResponse*) override {
    return ToGrpcStatus(policy_.Check(*ctx, "ListBlobs").status());
  }

 private:
  Policy policy_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir() + "/tls_test");
    std::filesystem::remove_all(*dir_);
    ASSERT_TRUE(EnsureCa(*dir_).ok());
    ASSERT_TRUE(Issue(*dir_, {Role::kMember, "store-0"}).ok());
    ASSERT_TRUE(Issue(*dir_, {Role::kCoordinator, "coordinator"}).ok());
    ASSERT_TRUE(Issue(*dir_, {Role::kUser, "alice"}).ok());
    ASSERT_TRUE(Issue(*dir_, {Role::kMember, "elsewhere"}, {.hosts = {"127.0.0.2"}}).ok());
    ASSERT_TRUE(EnsureCa(*dir_ + "/other").ok());
    ASSERT_TRUE(Issue(*dir_ + "/other", {Role::kCoordinator, "coordinator"}).ok());
  }
  static void TearDownTestSuite() { delete dir_; }

  // A TLS server as `server_name`, policy enforced.
  void Serve(const std::string& server_name) {
    auto security = TransportSecurity::Tls(*dir_ + "/" + server_name);
    ASSERT_TRUE(security.ok()) << security.status();
    auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0",
                                     .services = {&service_},
                                     .credentials = security->ServerCredentials()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }

  grpc::Status Call(std::shared_ptr<grpc::ChannelCredentials> credentials,
                    const char* method = "GetStats", v1::StoreStats* out = nullptr) {
    auto stub = v1::StoreService::NewStub(NewChannel(address_, std::move(credentials)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StoreStats stats;
    if (std::string(method) == "ListBlobs") {
      v1::ListBlobsResponse r;
      return stub->ListBlobs(&ctx, v1::ListBlobsRequest(), &r);
    }
    grpc::Status s = stub->GetStats(&ctx, v1::GetStatsRequest(), &stats);
    if (out != nullptr) *out = stats;
    return s;
  }
  // `name`'s credentials for a server of role `server` (the store-0 Serve() starts: a
  // member).
  std::shared_ptr<grpc::ChannelCredentials> As(const std::string& name,
                                               Role server = Role::kMember) {
    auto security = TransportSecurity::Tls(*dir_ + "/" + name);
    EXPECT_TRUE(security.ok()) << security.status();
    return security->ChannelCredentials(server);
  }

  static std::string* dir_;
  Service service_{true};
  std::unique_ptr<GrpcServer> server_;
  std::string address_;
};
std::string* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, TheRightRoleGetsInAndOthersAreRefusedWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(Serve("store-0"));
  v1::StoreStats stats;
  ASSERT_TRUE(Call(As("coordinator"), "GetStats", &stats).ok());
  EXPECT_EQ(stats.blobs(), std::string("coordinator").size());  // the caller was seen

  grpc::Status user = Call(As("alice"));
  EXPECT_EQ(user.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(user.error_message(),
            "GetStats needs the coordinator or admin role; the caller is alice (user)");
  // A method the policy does not name is refused to everyone.
  EXPECT_EQ(Call(As("coordinator"), "ListBlobs").error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(TlsTest, NoCertificateAForeignCaOrPlaintextGetsNothing) {
  ASSERT_NO_FATAL_FAILURE(Serve("store-0"));
  // TLS, the server checked, but no client certificate.
  grpc::SslCredentialsOptions anonymous;
  anonymous.pem_root_certs = ReadAll(*dir_ + "/ca.pem");
  grpc::Status none = Call(grpc::SslCredentials(anonymous));
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << none.error_message();
  EXPECT_NE(none.error_message().find("no client certificate"), std::string::npos);
  // A certificate of another cluster's CA: the handshake fails.
  EXPECT_EQ(Call(As("other/coordinator")).error_code(), grpc::StatusCode::UNAVAILABLE);
  // Plaintext to a TLS port.
  EXPECT_EQ(Call(grpc::InsecureChannelCredentials()).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ABearerTokenStandsInForACertificate) {
  ASSERT_NO_FATAL_FAILURE(Serve("store-0"));
  // A client directory with the CA alone: TLS that checks the server, no certificate.
  const std::string ca_only = *dir_ + "/ca-only";
  std::filesystem::create_directories(ca_only);
  std::filesystem::copy_file(*dir_ + "/ca.pem", ca_only + "/ca.pem",
                             std::filesystem::copy_options::overwrite_existing);
  auto anonymous = TransportSecurity::Tls(ca_only);
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  EXPECT_FALSE(anonymous->identity().has_value());
  v1::StoreStats stats;
  ASSERT_TRUE(
      Call(anonymous->WithToken("t0ken").ChannelCredentials(Role::kMember), "GetStats", &stats)
          .ok());
  EXPECT_EQ(stats.blobs(), std::string("ops").size());
  grpc::Status wrong = Call(anonymous->WithToken("guess").ChannelCredentials(Role::kMember));
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(wrong.error_message(),
            "GetStats: the bearer token is not valid (one just made with pith token is "
            "taken within a few seconds)");
  grpc::Status none = Call(anonymous->ChannelCredentials(Role::kMember));
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(TlsTest, AServerWhoseCertificateDoesNotNameTheAddressIsNotTrusted) {
  ASSERT_NO_FATAL_FAILURE(Serve("store-0"));
  // Dialled as another host than its certificate names (this machine's and 127.0.0.2).
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("elsewhere.example");
  auto stub =
      v1::StoreService::NewStub(grpc::CreateCustomChannel(address_, As("coordinator"), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StoreStats stats;
  EXPECT_EQ(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // The name a certificate was given with --hosts is one it answers to.
  grpc::ChannelArguments named;
  named.SetSslTargetNameOverride("127.0.0.2");
  ASSERT_NO_FATAL_FAILURE(Serve("elsewhere"));
  auto ok =
      v1::StoreService::NewStub(grpc::CreateCustomChannel(address_, As("coordinator"), named));
  grpc::ClientContext ctx2;
  EXPECT_TRUE(ok->GetStats(&ctx2, v1::GetStatsRequest(), &stats).ok());
}

// A client names the role it dials: a store's certificate does not pass for the
// coordinator's (its holder could take the tokens and the cluster key callers send), nor
// does a user's for a server at all (it names no host and no server use).
TEST_F(TlsTest, AServerOfAnotherRoleIsNotTrusted) {
  ASSERT_NO_FATAL_FAILURE(Serve("store-0"));
  EXPECT_TRUE(Call(As("coordinator", Role::kMember)).ok());
  EXPECT_EQ(Call(As("coordinator", Role::kCoordinator)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  ASSERT_NO_FATAL_FAILURE(Serve("alice"));
  EXPECT_EQ(Call(As("coordinator", Role::kMember)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(As("coordinator", Role::kUser)).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A person's certificate takes no host names.
  EXPECT_EQ(Issue(*dir_, {Role::kAdmin, "ops"}, {.hosts = {"node1"}}).code(),
            absl::StatusCode::kInvalidArgument);
  // Nor a name that is a file of the folder.
  EXPECT_EQ(Issue(*dir_, {Role::kUser, "ca.pem"}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(InsecureTest, PlaintextIsForLoopbackOnly) {
  const TransportSecurity insecure = TransportSecurity::Insecure();
  for (const char* ok : {"127.0.0.1:7000", "127.1.2.3:1", "localhost:7000", "[::1]:7000"}) {
    EXPECT_TRUE(insecure.CheckListen(ok).ok()) << ok;
    EXPECT_TRUE(insecure.CheckDial(ok).ok()) << ok;
  }
  for (const char* bad : {"0.0.0.0:7000", "10.0.0.1:7000", "[::]:7000", "node7:7000"}) {
    EXPECT_EQ(insecure.CheckListen(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(insecure.CheckDial(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto neither = TransportSecurity::Choose("", false, "pith-store");
  EXPECT_EQ(neither.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(neither.status().message().find("--tls_dir"), std::string::npos);
  EXPECT_NE(neither.status().message().find("--insecure"), std::string::npos);
  EXPECT_FALSE(TransportSecurity::Choose("/x", true, "pith-store").ok());
}

TEST(InsecureTest, APolicyNotEnforcedAdmitsEveryone) {
  Service service(/*enforce=*/false);
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
  ASSERT_TRUE(server.ok());
  auto stub = v1::StoreService::NewStub(NewChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                                   grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ListBlobsResponse r;
  EXPECT_TRUE(stub->ListBlobs(&ctx, v1::ListBlobsRequest(), &r).ok());
}

TEST_F(TlsTest, AProcessKnowsWhetherItsCertificateNamesItsAddress) {
  auto store = TransportSecurity::Tls(*dir_ + "/store-0");
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE(store->CheckNames("127.0.0.1").ok());
  EXPECT_TRUE(store->CheckNames("localhost").ok());
  absl::Status other = store->CheckNames("10.9.9.9");
  EXPECT_EQ(other.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(other.message().find("pith certs --hosts 10.9.9.9"), std::string::npos) << other;
  auto elsewhere = TransportSecurity::Tls(*dir_ + "/elsewhere");
  ASSERT_TRUE(elsewhere.ok());
  EXPECT_TRUE(elsewhere->CheckNames("127.0.0.2").ok());  // given with --hosts
  EXPECT_TRUE(TransportSecurity::Insecure().CheckNames("10.9.9.9").ok());
}

}  // namespace
}  // namespace pith::security
